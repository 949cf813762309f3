"""Every read and write of a lit3d checkpoint, in one folder: the folder of shards any layout reads
(`lit3d.checkpoint.folder`), reading one as data only, checked whole (`safe_io`), the strategy's saves and loads
(`save_load.Checkpoints`, with the whole state in one file: `whole_file`, and saves in the background: `background`),
the newest complete one for ``--ckpt_path last`` (`resume`), and the plain tensors a checkpoint holds (`plain`).

NOTE: below the model, the HuggingFace folders and the strategy: the strategy hands `save_load` its pieces (the layout,
the optimizers, the state of this rank) and ``GPT(pretrained=...)``, ``lit3d export`` and the CLI's resume read the
same folders.
"""
