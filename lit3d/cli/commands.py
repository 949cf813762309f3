"""The commands beside LightningCLI's: ``lit3d plan``, ``calibrate``, ``export``, ``convert``, ``generate`` and
``prepare``; each is a function whose arguments and docstring are its command line (jsonargparse)."""

from __future__ import annotations

from json import dumps, loads
from pathlib import Path

from lit3d.cli.plan_command import SWITCHES, plan  # noqa: F401 (the CLI's `lit3d plan`, and its flags that stand alone)
from lit3d.data.sources import check_source, load_documents
from lit3d.outputs import check_output, is_checkpoint_file
from lit3d.planner.calibrate import calibrate as measure
from lit3d.quiet import lightning_info_silenced


def export(ckpt_path: str, output: str, dtype: str = "float32", adapter: bool = False, overwrite: bool = False) -> None:
    """Write a lit3d checkpoint (any layout) as a HuggingFace folder: Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE.

    The family is the model config's ``family`` (that of the folder it started from, for ``GPT(pretrained=...)``).

    Args:
        ckpt_path: The checkpoint folder (e.g. ``runs/tiny/checkpoints/epoch=0-step=600.ckpt``).
        output: The folder to write: ``config.json`` (with the source's BOS/EOS ids), ``model.safetensors``, the
            source's ``generation_config.json`` and the run's tokenizer, loadable with
            ``transformers.AutoModelForCausalLM.from_pretrained(output)`` and ``AutoTokenizer``.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        adapter: A LoRA run's adapters alone, as a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``)
            that ``peft.PeftModel.from_pretrained`` loads on the base model; without it they are merged into the export.
        overwrite: Replace files of yours in ``output`` that an export writes (``config.json``, ...); without it they
            are refused, before anything is read. An earlier export there is replaced, and other files are kept.
    """
    import torch

    from lit3d.cli.export import export_checkpoint

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is not one of float32, bfloat16, float16")
    folder, files, notes = export_checkpoint(ckpt_path, output, getattr(torch, dtype), adapter, overwrite)
    print("\n".join([f"wrote {folder}: {', '.join(files)}", *notes]))


def calibrate(output: str = "cpu.json", processes: int = 1, overwrite: bool = False) -> None:
    """Measure this machine as the planner's clock sees a device, for ``lit3d plan --gpu OUTPUT``: GEMMs, attention,
    elementwise bandwidth, the time per operator and per step, and gloo's all-reduce between ``processes`` processes
    sharing it (each with its share of the cores, as a rehearsal's ranks have). About ten seconds.

    Args:
        output: The profile to write (JSON).
        processes: Processes sharing the machine, as many as the rehearsal planned with it runs.
        overwrite: Replace a file at ``output`` that is not a profile lit3d wrote (one it wrote is replaced anyway).
    """
    check_output(output, "profile", is_profile, overwrite=overwrite)  # NOTE: before the measuring (seconds)
    profile = measure(processes)
    Path(output).write_text(dumps(profile, indent=2))
    gpu = profile["gpu"]
    print(
        f"wrote {output}: {gpu['peak_tflops'] * 1e3:.1f} GFLOP/s per process, {gpu['memory_bandwidth_gbps']:.0f} GB/s,"
        f" {gpu['efficiency']['kernel_overhead_us']:.1f} us per operator, all-reduce at {gpu['intra_node_gbps']:.2f}"
        f" GB/s; plan with: lit3d plan --gpu {output} --gpus_per_node {processes} ..."
    )


def is_profile(path: Path) -> bool:
    """Whether ``path`` is a profile that `calibrate` wrote (the keys of its JSON object), which it may replace."""
    try:
        data = loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.keys() == {"gpu", "collective_latency_us", "processes"}


def convert(ckpt_path: str, output: str, overwrite: bool = False) -> None:
    """Write a lit3d checkpoint folder (any layout) as one Lightning checkpoint file.

    The file holds the whole weights, the loop state and the hyper-parameters, and loads on one process under any
    strategy (``lit3d validate|test|predict --ckpt_path FILE``, ``GPT.load_from_checkpoint``, ``GPT(pretrained=)``).
    The optimizer states stay in the folder: to resume training, resume from the folder (any layout).

    Args:
        ckpt_path: The checkpoint folder.
        output: The file to write.
        overwrite: Replace a file at ``output`` that is not a checkpoint (a checkpoint file is replaced anyway).
    """
    import torch

    from lit3d.checkpoint.folder import read_weights

    check_output(output, "checkpoint", is_checkpoint_file, overwrite=overwrite)  # before the checkpoint is read
    torch.save(read_weights(ckpt_path), output)
    print(f"wrote {output}")


def generate(
    ckpt_path: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    tokenizer: str | None = None,
    devices: int = 1,
    tensor_parallel_size: int = 1,
    accelerator: str = "auto",
    chat: bool = False,
) -> None:
    """Print the prompt and its continuation by a trained model; or with ``--chat``, the model's answer.

    Args:
        ckpt_path: A lit3d checkpoint (a folder written by any layout, or a single file) or a local HuggingFace
            model folder.
        prompt: The text to continue; or a conversation, as JSON: ``[{"role": "user", "content": "..."}, ...]``
            (or ``{"messages": [...]}``), which is answered as with ``--chat``.
        max_new_tokens: Tokens to generate.
        temperature: Sampling temperature; 0 is greedy.
        top_k: Sample among the k most likely tokens.
        top_p: Sample among the most likely tokens that reach this probability together.
        seed: Seed of the sampling: the same seed gives the same tokens on one device and in any TP layout.
        tokenizer: ``byte`` or a ``tokenizer.json`` (or its folder, with the chat template ``--chat`` uses); default:
            the run's own (or the HuggingFace folder's).
        devices: Processes (GPUs) to run on; more than one splits the model with tensor parallelism.
        tensor_parallel_size: Ranks that split each layer (``devices`` by default when it is more than one).
        accelerator: ``cpu``, ``gpu`` or ``auto``.
        chat: Answer the prompt as a user's turn: rendered with the chat template of the model's tokenizer folder,
            generation stops at the end of the assistant's turn, and the answer alone is printed.
    """
    import lightning as L

    from lit3d.callbacks import PrintCompletions
    from lit3d.data.prompts import ChatPrompt, prompt_data
    from lit3d.models.generation import Sampling
    from lit3d.models.gpt import GPT
    from lit3d.strategies import Parallel3DStrategy

    data = prompt_data(ckpt_path, prompt, tokenizer, chat)
    sampling = Sampling(max_new_tokens, temperature, top_k, top_p, seed, getattr(data, "stop_ids", ()))
    model = GPT(pretrained=ckpt_path, sampling=sampling)  # a LoRA run's adapters merged in (`read_tensors`)
    tp = tensor_parallel_size if tensor_parallel_size > 1 else devices
    strategy = Parallel3DStrategy(tensor_parallel_size=tp, zero_stage=0) if devices > 1 else "auto"
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    printer = PrintCompletions(prompt=not isinstance(data, ChatPrompt))  # a chat's answer alone
    L.seed_everything(seed, verbose=False)  # every rank alike, as the strategy asks (sampling has its own generator)
    with lightning_info_silenced():  # the text alone (and any warning)
        trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, callbacks=[printer], **quiet)
        trainer.predict(model, datamodule=data, return_predictions=False)


def prepare(
    data_path: str,
    output: str,
    tokenizer: str = "byte",
    text_column: str = "text",
    name: str | None = None,
    split: str = "train",
    num_proc: int = 2,
    shard_tokens: int = 2**27,
    overwrite: bool = False,
) -> None:
    """Tokenize a corpus once, with several processes, into token shards that training reads memory-mapped
    (``TextDataModule(data_path=OUTPUT)``, with the same tokenizer).

    Args:
        data_path: Any source `TextDataModule` reads (files by format, folders, globs, ``hf:NAME``, saved datasets).
        output: A new folder for ``index.json`` and the ``tokens-*.bin`` shards.
        tokenizer: ``byte`` or a ``tokenizer.json`` (or a folder holding one).
        text_column: The column holding the text in tables and datasets.
        name: The configuration of an ``hf:`` dataset.
        split: The split of an ``hf:`` dataset or a saved ``DatasetDict``.
        num_proc: Tokenizing processes.
        shard_tokens: Tokens per shard file.
        overwrite: Replace what a folder at ``output`` holds (a corpus prepared before included); without it a folder
            that is not empty is refused, before any tokenizing.
    """
    import time

    from lit3d.data.prepared import prepared_output, throughput, write
    from lit3d.data.tokenizers import load_tokenizer

    if num_proc < 1 or shard_tokens < 1:
        raise ValueError(f"num_proc={num_proc} and shard_tokens={shard_tokens} must be positive")
    check_source(data_path)
    prepared_output(output, overwrite)  # before the documents are read
    start = time.perf_counter()
    documents = load_documents(data_path, text_column, name, split)
    index = write(documents, load_tokenizer(tokenizer), tokenizer, output, num_proc, shard_tokens, overwrite)
    print(throughput(index, documents.data.nbytes, time.perf_counter() - start, num_proc))
