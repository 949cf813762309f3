"""lit3d's checkpoints on disk: the folder of shards any layout reads (`lit3d.checkpoint.folder`) and reading one as
data only, checked whole (`lit3d.checkpoint.safe_io`).

NOTE: below the model, the HuggingFace folders and the strategy: the strategy writes these folders
(`lit3d.strategies.checkpoints`), and ``GPT(pretrained=...)``, ``lit3d export`` and the CLI's resume read them.
"""
