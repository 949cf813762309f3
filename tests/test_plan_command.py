"""``lit3d plan`` as a command: its numbers refused by name, its help, the device table, the rank map picture, the
MoE example of docs/expert-parallel.md, and a CPU rehearsal planned on a CPU. (tests/test_docs.py runs every other
plan the docs show and checks the output they quote.)"""

import json

import pytest

from lit3d.cli import main
from lit3d.parallel.layout import Layout
from lit3d.planner import RankMap


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--seq_len", "0", "seq_len=0"),
        ("--micro_batch_size", "0", "micro_batch_size=0"),
        ("--gpu_memory", "0", "gpu_memory=0.0"),
        ("--peak_tflops", "0", "peak_tflops=0.0"),
        ("--intra_node_bandwidth", "0", "intra_node_bandwidth=0.0"),
        ("--inter_node_bandwidth", "0", "inter_node_bandwidth=0.0"),
        ("--virtual_pipeline_size", "0", "virtual_pipeline_size=0"),
        ("--inter_island_bandwidth", "0", "inter_island_bandwidth=0.0"),
        ("--inter_island_latency", "-1", "inter_island_latency=-1.0"),
    ],
)
def test_plan_refuses_zero_and_negative_numbers_naming_the_value(flag, value, named, capsys):
    """``--seq_len 0`` was taken as "not given" and planned the model's default length."""
    with pytest.raises(SystemExit) as error:
        main(["plan", "--model", "tiny", "--gpus_per_node", "2", flag, value])
    message = str(error.value.code)
    assert message.startswith("lit3d plan: error: ") and named in message and "\n" not in message, message
    assert "layout(s) fit" not in capsys.readouterr().out


def test_plan_help_lists_every_preset(capsys):
    from lit3d.config import PRESETS

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    missing = [name for name in PRESETS if name not in text]
    assert not missing and "mixtral-8x7b" in text, missing


def test_the_gpu_table_knows_blackwell_and_mi300x_with_their_datasheet_numbers():
    from lit3d.hardware import GPUS, identify

    assert (GPUS["B200"].peak_tflops, GPUS["B200"].memory_gb, GPUS["B200"].intra_node_gbps) == (2250, 180, 900)
    assert (GPUS["GB200"].peak_tflops, GPUS["GB200"].memory_gb, GPUS["GB200"].intra_node_gbps) == (2500, 186, 900)
    assert (GPUS["MI300X"].peak_tflops, GPUS["MI300X"].memory_gb, GPUS["MI300X"].memory_bandwidth_gbps) == (
        1307.4,
        192,
        5300,
    )
    assert all(gpu.memory_bandwidth_gbps > 0 for gpu in GPUS.values())
    names = {
        "NVIDIA B200": "B200",
        "NVIDIA GB200": "GB200",
        "AMD Instinct MI300X": "MI300X",
        "NVIDIA H100 80GB HBM3": "H100",
    }
    assert {device: identify(device).name for device in names} == names


def test_a_search_map_stacks_its_layouts_at_a_readable_width():
    """Three 64-GPU layouts side by side were 3,690 x 960 pixels with 6-point labels: unreadable once shrunk."""
    import matplotlib.pyplot as plt

    from lit3d.planner.rankmap import DPI

    layouts = [Layout(dp=8 // pp, tp=8, pp=pp, devices_per_node=8) for pp in (1, 2, 4)]
    figure = RankMap.side_by_side([RankMap(layout, f"#{i}") for i, layout in enumerate(layouts, 1)]).figure()
    width, height = figure.get_size_inches() * DPI  # the saved .png's pixels
    sizes = [t.get_fontsize() for ax in figure.axes for t in ax.texts]
    plt.close(figure)
    assert width <= 1600 and height > width, (width, height)
    assert min(sizes) >= 8


def test_rank_map_stage_colours_do_not_repeat_up_to_128_stages():
    import matplotlib.pyplot as plt

    figure = RankMap(Layout(dp=1, tp=1, pp=128, devices_per_node=8)).figure()
    colours = [tuple(round(c, 3) for c in patch.get_facecolor()[:3]) for patch in figure.axes[0].patches]
    plt.close(figure)
    assert len(colours) == 128 and len(set(colours)) == 128  # rank r is stage r here
    neighbours = [sum((a - b) ** 2 for a, b in zip(colours[p], colours[p + 1])) ** 0.5 for p in range(127)]
    assert min(neighbours) > 0.25  # adjacent stages stand apart, not just differ


def test_the_docs_moe_plan_commands_pick_the_layouts_they_quote(capsys):
    """docs/expert-parallel.md names the layouts its two plans pick (the README once said `--nodes 8` picks DP64 with
    EP4; it picked DP2 x CP8 x PP4 at 32,768 tokens)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "expert-parallel.md").read_text()
    commands = re.findall(r"`(lit3d plan --model mixtral-8x7b[^`]*)`", page)

    def grid(layout: dict) -> str:  # as the page writes a layout
        axes = [("CP", layout["context_parallel_size"]), ("PP", layout["pipeline_parallel_size"]),
                ("EP", layout["expert_parallel_size"])]  # fmt: skip
        return " × ".join([f"DP{layout['data_parallel_size']}", *(f"{name}{n}" for name, n in axes if n > 1)])

    ranked = {}
    for command in commands:
        main([*command.split()[1:], "--json"])
        report = json.loads(capsys.readouterr().out)
        plans = [report, *report["alternatives"]]
        ranked[command] = (list(dict.fromkeys(grid(p["layout"]) for p in plans)), [p["step_time_s"] for p in plans])
    grids, times = ranked["lit3d plan --model mixtral-8x7b --nodes 8 --seq_len 4096"]
    assert grids[:3] == ["DP32 × PP2 × EP8", "DP16 × PP4 × EP4", "DP4 × PP16"], grids
    assert max(times[:3]) < 1.01 * times[0]
    assert ranked["lit3d plan --model mixtral-8x7b --nodes 8"][0][0] == "DP1 × CP8 × PP8"
    assert "ranks DP32 × PP2 × EP8, DP16 × PP4 × EP4 and DP4 × PP16 first" in " ".join(page.split())
    assert "splits each sequence instead: CP8 × PP8" in " ".join(page.split())


def test_a_cpu_rehearsal_plans_with_its_share_of_this_machines_cpu():
    from lit3d.hardware import GPUS, cpu_share

    share = cpu_share(8, cores=16, memory_gb=32.0)
    assert (share.device, share.memory_gb) == ("CPU process", 4.0)
    assert share.peak_tflops == pytest.approx(2 * GPUS["CPU"].peak_tflops) and share.peak_tflops < 1
    with pytest.raises(ValueError, match="processes=0"):
        cpu_share(0)
