"""The planner's page (``lit3d plan ... --html``) in a real browser: headless Chromium (Debian's, driven by
Playwright; no browser is downloaded) with every request that is not the page's own file refused. The d slider
moved by keyboard changes the GPU count and the cells drawn, ZeRO-3 divides a GPU's optimizer state by d, a clicked
GPU shows what ``lit3d plan --json`` prints for that layout, and the page stays under 2 MB for 1,024 GPUs.

Without Chromium the browser tests skip here, and fail where ``BROWSER_TESTS=required`` (`.ci/run` sets it
after installing Debian's ``chromium``)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from lit3d.cli import main
from lit3d.models.config import GPTConfig
from lit3d.planner import Cluster
from lit3d.planner.explore import explore, layout_key
from lit3d.planner.request import Request, plan

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PLAN = ["--model", "llama-70b", "--nodes", "8", "--seq_len", "4096", "--global_batch_size", "512"]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, or a skip (a failure where CI requires it)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if CHROMIUM is None or sync_playwright is None:
        missing = "Debian's chromium" if CHROMIUM is None else "playwright"
        if os.environ.get("BROWSER_TESTS") == "required":
            pytest.fail(f"{missing} is not installed, and BROWSER_TESTS=required")
        pytest.skip(f"{missing} is not installed (apt-get install chromium; pip install playwright)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("page") / "plan.html"
    main(["plan", *PLAN, "--html", str(path)])
    return path


def open_offline(browser, path):
    """The page from its file, every other request refused (and recorded)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    elsewhere = []

    def only_the_file(route):
        if route.request.url.startswith("file:"):
            return route.continue_()
        elsewhere.append(route.request.url)
        return route.abort()

    context.route("**/*", only_the_file)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    return page, elsewhere, errors


def set_slider(page, name, value, values):
    page.eval_on_selector(f"#{name}", "(el, i) => { el.value = i; el.dispatchEvent(new Event('input')); }",
                          values.index(value))  # fmt: skip


def planned(t, p, d, zero, capsys):
    """What ``lit3d plan --json`` prints for that layout."""
    capsys.readouterr()
    sizes = {"tensor_parallel_size": t, "pipeline_parallel_size": p, "data_parallel_size": d, "zero_stage": zero}
    main(["plan", *PLAN, *(f"--{name}={value}" for name, value in sizes.items()), "--pipeline_schedule=1f1b", "--json"])
    return json.loads(capsys.readouterr().out)


def test_the_page_answers_as_the_planner_offline_in_chromium(browser, page_file, tmp_path, capsys):
    page, elsewhere, errors = open_offline(browser, page_file)
    data = json.loads(page.text_content("#data"))
    set_slider(page, "t", 8, data["axes"]["t"])
    set_slider(page, "p", 4, data["axes"]["p"])
    page.select_option("#zero", "0")
    page.focus("#d")
    page.keyboard.press("Home")  # d = 1
    assert page.text_content("#total") == "32" and page.locator(".gpu").count() == 32
    page.keyboard.press("ArrowRight")  # d = 2: the slider, moved as a user moves it
    assert page.text_content("#total") == "64" and page.locator(".gpu").count() == 64
    assert page.text_content("#grids") == "2"

    page.click('.gpu[data-rank="45"]')  # t5 of the second replica's stage 2: (t, d, p) = (5, 1, 2)
    unsharded = float(page.get_attribute("#mem-optimizer", "data-bytes"))
    page.select_option("#zero", "3")
    page.click('.gpu[data-rank="45"]')
    sharded = float(page.get_attribute("#mem-optimizer", "data-bytes"))
    assert sharded == pytest.approx(unsharded / 2, rel=1e-3)  # ZeRO-3: the optimizer state over d = 2 replicas

    report = planned(8, 4, 2, 3, capsys)
    stage = report["memory_by_stage"][2]
    for name in ("params", "grads", "optimizer", "activations", "total"):
        assert float(page.get_attribute(f"#mem-{name}", "data-bytes")) == int(stage[name]), name
    for axis, numbers in report["communication_per_step"].items():
        if numbers["bytes"]:
            assert float(page.get_attribute(f"#comm-{axis}", "data-bytes")) == numbers["bytes"], axis
    assert "step" in page.text_content("#status") and page.locator("#ranking li").count() > 0
    page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
    assert (tmp_path / "page.png").stat().st_size > 10_000
    assert not elsewhere and not errors, (elsewhere, errors)


def test_a_ranked_layout_is_one_click_away_and_a_layout_that_does_not_fit_says_why(browser, page_file):
    page, _, errors = open_offline(browser, page_file)
    data = json.loads(page.text_content("#data"))
    best = data["ranking"][0]
    page.click(f'#ranking li[data-key="{best}"]')
    d, t, p, *_ = map(int, best.split(","))
    assert page.text_content("#total") == str(d * t * p)
    set_slider(page, "t", 1, data["axes"]["t"])
    set_slider(page, "p", 1, data["axes"]["p"])
    page.select_option("#zero", "0")
    assert "does not fit" in page.text_content("#status")
    assert page.locator(".gpu.over").count() > 0
    set_slider(page, "t", 8, data["axes"]["t"])
    set_slider(page, "p", 16, data["axes"]["p"])  # 128 GPUs of 64
    assert "more than the cluster has" in page.text_content("#status") and page.locator(".gpu").count() == 0
    assert not errors, errors


def test_the_page_fetches_nothing_and_a_notebook_shows_it_in_a_frame():
    explorer = explore("tiny", Cluster(nodes=1, gpus_per_node=2), seq_len=64, global_batch_size=8)
    html = explorer.html()
    assert "default-src 'none'" in html and "http://" not in html and "https://" not in html
    frame = explorer._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "&lt;script" in frame and 'sandbox="allow-scripts"' in frame


def test_an_moe_page_names_each_gpu_s_share_of_the_experts_and_outlines_its_expert_group(browser, tmp_path):
    """Issue 47, item 15: with ep 2 over d 8, GPU 3 (d3) holds the second half of the experts of group 1 (d2, d3)."""
    explorer = explore("moe-tiny", Cluster(nodes=1, gpus_per_node=8), seq_len=256, global_batch_size=64)
    page, elsewhere, errors = open_offline(browser, Path(explorer.save(str(tmp_path / "moe.html"))))
    data = explorer.data
    set_slider(page, "t", 1, data["axes"]["t"])
    set_slider(page, "p", 1, data["axes"]["p"])
    set_slider(page, "ep", 2, data["axes"]["ep"])
    page.focus("#d")
    page.keyboard.press("End")  # d = 8
    page.check("#show-ep")
    page.click('.gpu[data-rank="3"]')
    titles = [page.get_attribute(f'.gpu[data-rank="{r}"]', "title") for r in range(4)]
    assert titles == [f"GPU {r}: t0 p0 d{r} e{r % 2}, expert group {r // 2}" for r in range(4)]
    assert [int(r) for r in page.eval_on_selector_all(".gpu.ep", "cells => cells.map(c => c.dataset.rank)")] == [2, 3]
    panel = page.text_content("#panel")
    assert "expert group 1: 2 GPUs (d 2-3), each holding 1/2 of every MoE layer's experts" in panel
    assert not elsewhere and not errors, (elsewhere, errors)


def test_a_page_of_replica_groups_shows_group_0_its_average_and_what_a_rejoining_group_loads(browser, tmp_path):
    """``--replica_groups 3``: the page is one group's layouts (the nodes given are each group's), says so, and a GPU
    shows the bytes it sends to the other groups each step and loads from a live group when its own rejoins, as
    ``lit3d plan`` plans them."""
    given = dict(seq_len=1024, global_batch_size=32, replica_groups=3)
    explorer = explore("llama-8b", Cluster(nodes=1, gpus_per_node=8), **given)
    page, elsewhere, errors = open_offline(browser, Path(explorer.save(str(tmp_path / "groups.html"))))
    assert "3 replica groups (torchft)" in page.text_content(".sub") and "group 0's shown" in page.text_content(".sub")
    best = explorer.data["ranking"][0]
    page.click(f'#ranking li[data-key="{best}"]')
    page.click('.gpu[data-rank="0"]')
    d, t, p, ep, cp, zero = map(int, best.split(","))
    sizes = dict(data_parallel_size=d, tensor_parallel_size=t, pipeline_parallel_size=p, zero_stage=zero)
    request = Request.given(GPTConfig.load("llama-8b"), Cluster(nodes=1, gpus_per_node=8), **given, **sizes)
    planned = plan(request).chosen.plan
    sent = planned.communication_per_step["replica"]["bytes"]
    assert float(page.get_attribute("#rejoin", "data-bytes")) == planned.rejoin_bytes() > 0
    assert float(page.get_attribute("#comm-replica", "data-bytes")) == sent > 0
    assert "replica group 0 of 3" in page.text_content("#panel")
    assert not elsewhere and not errors, (elsewhere, errors)


def gpt3_page():
    return explore("gpt3-175b", Cluster(nodes=128), seq_len=2048, global_batch_size=1536)


def show_gpt3(page, data):
    """GPT-3 175B at TP8 x PP16 x DP8 on the page: all 1,024 GPUs, the last one selected, its TP group outlined."""
    set_slider(page, "t", 8, data["axes"]["t"])
    set_slider(page, "p", 16, data["axes"]["p"])
    page.select_option("#zero", "1")
    page.focus("#d")
    page.keyboard.press("End")  # d = 1024 / (8 x 16) = 8
    page.check("#show-tp")
    page.click('.gpu[data-rank="1023"]')
    page.evaluate("window.scrollTo(0, 0)")


def test_a_1024_gpu_page_is_under_2_mb_and_shows_gpt3_at_tp8_pp16_dp8(browser, tmp_path):
    explorer = gpt3_page()
    html = explorer.html()
    assert len(html.encode()) < 2e6, len(html.encode())
    entry = explorer.data["layouts"][layout_key(8, 8, 16, 1, 1, 1)]
    assert entry["fits"] and len(entry["stages"]) == 16
    page, elsewhere, errors = open_offline(browser, Path(explorer.save(str(tmp_path / "gpt3.html"))))
    show_gpt3(page, explorer.data)
    assert page.text_content("#total") == "1024" and page.locator(".gpu").count() == 1024
    assert page.locator(".gpu.tp").count() == 8 and "step" in page.text_content("#status")
    page.screenshot(path=str(tmp_path / "gpt3.png"))
    assert not elsewhere and not errors, (elsewhere, errors)


if __name__ == "__main__":  # the docs' page and pictures: python tests/test_page.py
    import subprocess
    import sys

    from playwright.sync_api import sync_playwright

    docs = Path(__file__).resolve().parents[1] / "docs"
    subprocess.run([sys.executable, "-m", "lit3d.cli", "plan", *PLAN, "--html", str(docs / "planner_page.html")],
                   check=True)  # fmt: skip
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page, _, _ = open_offline(chromium, docs / "planner_page.html")
        page.check("#show-tp")
        page.check("#show-pp")
        page.click('.gpu[data-rank="45"]')
        page.screenshot(path=str(docs / "planner_page.png"))
        explorer = gpt3_page()
        page, _, _ = open_offline(chromium, Path(explorer.save(str(Path("/tmp") / "gpt3_page.html"))))
        show_gpt3(page, explorer.data)
        page.screenshot(path=str(docs / "planner_page_gpt3.png"))
        chromium.close()
