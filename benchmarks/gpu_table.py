"""The markdown table of `benchmarks/gpu_check.py` and its targets (on an H100 or H200), from its results."""

from __future__ import annotations

from typing import Any

# Every row the table has, by section: (item as the section records it, the row's label).
PEER_ROWS = (
    ("3d", "Parallel3DStrategy 1x1x1"),
    ("auto", "Lightning auto, the same lit3d.GPT"),
    ("transformers", "transformers LlamaForCausalLM, plain loop"),
)
PLANNER_ROWS = (
    ("3d eager", "Parallel3DStrategy 1x1x1, compile off"),
    ("3d compile", "Parallel3DStrategy 1x1x1, compile on"),
)
FP8_ROWS = (
    ("wide bf16", "bf16"),
    ("wide tensorwise", "tensorwise"),
    ("wide rowwise", "rowwise"),
    ("model tensorwise", "tensorwise"),
    ("model rowwise", "rowwise"),
)
EXTRA_ROWS = (
    ("lora", "LoRA (rank 16, every linear) on the peers' model"),
    ("zero3 offload", "ZeRO-3 with offload=True on one rank"),
    ("checkpoint sync", "checkpoint save, synchronous"),
    ("checkpoint async", "checkpoint save, asynchronous"),
    ("resume", "resume from the asynchronous checkpoint"),
    ("generate", "lit3d generate"),
    ("window attention", "windowed attention, forward and backward: lit3d against SDPA with a full mask"),
)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issue 48 with its value in this run and whether it is met (None: not measured, or a dry run,
    whose CPU the targets are not for)."""
    sections = results["sections"]
    peers = sections.get("peers", {}).get("items", {})
    fp8 = sections.get("fp8", {}).get("items", {})
    plans = sections.get("planner", {}).get("items", {})
    rows = []

    def add(name: str, value: float | None, low: float, high: float = float("inf")) -> None:
        met = None if value is None or results["dry_run"] else low <= value <= high
        rows.append({"target": name, "value": value, "met": met})

    for on, label in (("eager", "compile off"), ("compile", "compile on")):
        add(f"lit3d >= 0.98 x Lightning auto, the same GPT ({label})", ratio(peers, f"3d {on}", f"auto {on}"), 0.98)
    for on, label in (("eager", "compile off"), ("compile", "compile on")):
        add(f"lit3d >= 1.10 x the transformers loop ({label})", ratio(peers, f"3d {on}", f"transformers {on}"), 1.10)
    add("MFU >= 45 % with compile", peers.get("3d compile", {}).get("mfu"), 0.45)
    for recipe in ("tensorwise", "rowwise"):
        add(f"FP8 {recipe} >= 1.3 x bf16 at d_model >= 4096", ratio(fp8, f"wide {recipe}", "wide bf16"), 1.3)
    for on, label in (("eager", "compile off"), ("compile", "compile on")):
        planned, measured = plans.get(f"3d {on}", {}), peers.get(f"3d {on}", {})
        value = planned["step_s"] / measured["step_s"] if "step_s" in planned and "step_s" in measured else None
        add(f"planner's step time within 15 % of the measured ({label})", value, 0.85, 1.15)
    return rows


def ratio(items: dict[str, Any], ours: str, theirs: str) -> float | None:
    """Tokens/s of ``ours`` over ``theirs``, None unless both were measured."""
    a, b = items.get(ours, {}).get("tokens_per_s"), items.get(theirs, {}).get("tokens_per_s")
    return a / b if a and b else None


def markdown(results: dict[str, Any]) -> str:
    sections, environment = results["sections"], results.get("environment", {})
    lines = [f"# lit3d on a GPU: {environment.get('device', 'no device information')}", ""]
    if results["dry_run"]:
        lines += ["A dry run: the code path on CPU with tiny shapes; its figures are not the GPU's.", ""]
    lines += heading(results, environment)
    lines += peers_table(sections.get("peers", {}), results["settings"])
    lines += planner_table(sections.get("planner", {}), sections.get("peers", {}).get("items", {}))
    lines += fp8_table(sections.get("fp8", {}), sections.get("peers", {}).get("items", {}), results["settings"])
    lines += extras_table(sections.get("extras", {}))
    lines += ["## Targets (on an H100 or H200)", "", "| target | value | met |", "|---|---:|---|"]
    for row in results["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a (dry run)" if results["dry_run"] else "not measured"}
        value = percent(row["value"]) if row["target"].startswith("MFU") else number(row["value"], 3)
        lines.append(f"| {row['target']} | {value} | {met[row['met']]} |")
    return "\n".join(lines) + "\n"


def heading(results: dict[str, Any], environment: dict[str, Any]) -> list[str]:
    memory = environment.get("memory_bytes")
    card = ", ".join(
        part
        for part in (
            f"lit3d/planner/hardware.py: {environment.get('hardware')}"
            if environment.get("hardware")
            else "not in lit3d's table",
            f"compute capability {'.'.join(map(str, environment['capability']))}"
            if environment.get("capability")
            else "",
            f"{memory / 2**30:.1f} GiB" if memory else "",
        )
        if part
    )
    versions = ", ".join(
        f"{name} {environment[key]}"
        for name, key in (
            ("Python", "python"),
            ("PyTorch", "torch"),
            ("CUDA", "cuda"),
            ("Lightning", "lightning"),
            ("transformers", "transformers"),
            ("torchao", "torchao"),
        )
        if environment.get(key)
    )
    return [
        "| | |",
        "|---|---|",
        f"| device | {environment.get('device', '-')} ({card}) |",
        f"| software | {versions or '-'} |",
        f"| commit | {results['commit']} |",
        f"| date | {results['date']} |",
        f"| wall-clock | {results['wall_s']:.0f} s of a {results['budget_s']:.0f} s budget |",
        "",
    ]


def peers_table(peers: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    model = settings["model"]["name"]
    lines = [
        f"## lit3d against its peers on this card ({model}, bf16-mixed, seq {settings['seq_len']}, micro-batch "
        f"{peers.get('micro_batch', '-')}, fused AdamW)",
        "",
        *section_note(peers),
        "| run | compile | tokens/s | MFU | peak memory (GB) | lit3d's tokens/s over this | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    items = peers.get("items", {})
    for on in ("eager", "compile"):
        for system, label in PEER_ROWS:
            item = items.get(f"{system} {on}", {})
            versus = number(ratio(items, f"3d {on}", f"{system} {on}"), 3)
            lines.append(
                f"| {label} | {'on' if on == 'compile' else 'off'} | {number(item.get('tokens_per_s'), 0)} | "
                f"{percent(item.get('mfu'))} | {number(item.get('peak_gb'), 2)} | {versus} | {note(item)} |"
            )
    return lines + [""]


def planner_table(planner: dict[str, Any], peers: dict[str, Any]) -> list[str]:
    lines = [
        f'## The planner on this card (`lit3d plan --json --gpu "{planner.get("gpu", "-")}"`, the same run)',
        "",
        *section_note(planner),
        "| run | measured step (s) | planned step (s) | planned / measured | measured peak (GB) | planned peak (GB) | "
        "planned / measured |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for item, label in PLANNER_ROWS:
        plan, measured = planner.get("items", {}).get(item, {}), peers.get(item, {})
        steps = (measured.get("step_s"), plan.get("step_s"))
        peaks = (measured.get("peak_gb"), plan.get("peak_gb"))
        cells = [
            number(steps[0], 4),
            number(steps[1], 4),
            quotient(*steps),
            number(peaks[0], 2),
            number(peaks[1], 2),
            quotient(*peaks),
        ]
        lines.append(f"| {label} | {' | '.join(cells)} |" + (f" {plan['error']}" if "error" in plan else ""))
    return lines + [""]


def fp8_table(fp8: dict[str, Any], peers: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    wide, model = settings["fp8_model"], settings["model"]
    names = {"wide": f"{wide['name']} (d_model {wide['d_model']}, {wide['n_layer']} blocks)", "model": model["name"]}
    lines = [
        "## FP8 against bf16 (Parallel3DStrategy 1x1x1, compiled)",
        "",
        *section_note(fp8),
        "| model | recipe | tokens/s | over bf16 | micro-batch | note |",
        "|---|---|---:|---:|---:|---|",
    ]
    items = {**fp8.get("items", {}), "model bf16": peers.get("3d compile", {})}  # the 1B's bf16: the peers' run
    for item, recipe in FP8_ROWS:
        shape = item.split()[0]
        row = items.get(item, {})
        versus = number(ratio(items, item, f"{shape} bf16"), 3)
        lines.append(
            f"| {names[shape]} | {recipe} | {number(row.get('tokens_per_s'), 0)} | {versus} | "
            f"{row.get('micro_batch', '-')} | {note(row)} |"
        )
    return lines + [""]


def extras_table(extras: dict[str, Any]) -> list[str]:
    lines = [
        "## What else must work on CUDA",
        "",
        *section_note(extras),
        "| check | result | figure |",
        "|---|---|---|",
    ]
    items = extras.get("items", {})
    for item, label in EXTRA_ROWS:
        row = items.get(item, {})
        lines.append(f"| {label} | {status(row)} | {figure(item, row, items)} |")
    return lines + [""]


def figure(item: str, row: dict[str, Any], items: dict[str, Any]) -> str:
    if "error" in row or "skipped" in row or not row:
        return ""
    if item in ("lora", "zero3 offload"):
        return f"{number(row['tokens_per_s'], 0)} tokens/s, {row['step_s']:.3f} s/step, peak {row['peak_gb']:.2f} GB"
    if item.startswith("checkpoint"):
        return f"training blocked {row['blocked_s']:.2f} s ({row['checkpoint_gb']:.2f} GB)"
    if item == "window attention":
        ms = row["ms"]
        return (
            f"window {row['window']} of {row['seq']} tokens, {row['heads']}/{row['kv_heads']} heads of"
            f" {row['head_dim']}"
            f" ({row['dtype']}): lit3d {ms['lit3d_window']:.2f} ms, SDPA with the full mask {ms['sdpa_full_mask']:.2f}"
            f" ms ({row['over_full_mask']:.2f}x lit3d's), causal without a window {ms['causal_no_window']:.2f} ms;"
            f" outputs within {row['max_difference']:.1e}"
        )
    if item == "resume":
        return f"its {len(row['losses'])} losses match the saving run's within {row['max_difference']:.1e}"
    return f"{number(row['tokens_per_s'], 1)} tokens/s" + (f" ({row['note']})" if "note" in row else "")


def status(row: dict[str, Any]) -> str:
    if not row:
        return "not run"
    if "error" in row:
        return f"error: {row['error']}"
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    return "ok"


def note(row: dict[str, Any]) -> str:
    return row.get("note", "") if status(row) == "ok" else status(row)


def section_note(section: dict[str, Any]) -> list[str]:
    said = [f"{key}: {section[key]}" for key in ("skipped", "error") if key in section]
    return [f"({'; '.join(said)})", ""] if said else []


def number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def quotient(measured: float | None, planned: float | None) -> str:
    return f"{planned / measured:.3f}" if measured and planned else "-"
