"""Check what TensorBoard shows of a precision sweep, in headless Chromium (issue 12).

Runs (or reuses) a debug sweep ``precision=fp32,bf16 model=xvector device=cpu``, starts
``tensorboard --logdir`` on it, opens the Time Series and HParams dashboards and checks,
without clicking anything, that both runs and their precision are visible: in the run
list (the ``precision=...`` part of each run name is not cut off) and in the HParams
table (a ``precision`` column with ``fp32`` and ``bf16``). It reads the DOM text and
saves PNG screenshots.

Needs Chromium and its driver (Debian: ``apt-get install -y chromium chromium-driver``) and
selenium, which is not a project dependency; use a throwaway environment::

    python3 -m venv /tmp/selvenv && /tmp/selvenv/bin/pip install selenium
    /tmp/selvenv/bin/python benchmarks/tensorboard_check.py \\
        --python .venv/bin/python --out benchmarks/results/2026-11-23-tensorboard

``--python`` is the project's interpreter (it runs the sweep and TensorBoard).
``--sweep-dir DIR`` reuses a finished sweep. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16")

# TensorBoard's HParams dashboard is Polymer: its text is inside shadow roots (and an
# iframe in some versions), which ``innerText`` does not enter. These helpers walk them.
_TEXT_NODES_JS = """
function textNodes(root, out) {
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_ELEMENT | NodeFilter.SHOW_TEXT);
  let node = walker.currentNode;
  while (node) {
    if (node.nodeType === Node.TEXT_NODE) {
      const tag = node.parentElement ? node.parentElement.tagName : '';
      if (node.textContent.trim() && !['STYLE', 'SCRIPT', 'NOSCRIPT'].includes(tag)) out.push(node);
    } else {
      if (node.shadowRoot) textNodes(node.shadowRoot, out);
      const frame = node.tagName === 'IFRAME' ? node.contentDocument : null;
      if (frame) textNodes(frame.body, out);
    }
    node = walker.nextNode();
  }
  return out;
}
"""

# Every text containing ``needle``, and whether that needle is inside the visible box of
# each clipping ancestor (run names are cut with CSS ellipsis; the DOM text is whole).
_VISIBLE_JS = (
    _TEXT_NODES_JS
    + """
const needle = arguments[0];
const found = [];
for (const node of textNodes(document.body, [])) {
  const at = node.textContent.indexOf(needle);
  if (at < 0) continue;
  const range = node.ownerDocument.createRange();
  range.setStart(node, at);
  range.setEnd(node, at + needle.length);
  const text = range.getBoundingClientRect();
  let visible = text.width > 0;
  let box = node.parentElement;
  for (; box && visible; box = box.parentElement || box.getRootNode().host) {
    const style = getComputedStyle(box);
    if (style.overflow !== 'visible' || style.textOverflow === 'ellipsis') {
      const clip = box.getBoundingClientRect();
      if (text.right > clip.right + 1 || text.left < clip.left - 1) visible = false;
    }
  }
  found.push({text: node.textContent.trim(), visible: visible});
}
return found;
"""
)

_ALL_TEXT_JS = (
    _TEXT_NODES_JS
    + """
return textNodes(document.body, []).map(n => n.textContent.trim()).join('\\n');
"""
)


def free_port() -> int:
    """A free local TCP port for TensorBoard."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_sweep(python: str, sweep_dir: Path) -> None:
    """The debug precision sweep the check looks at (a minute or two on CPU)."""
    command = [
        python,
        "recipes/train.py",
        "-m",
        f"precision={','.join(PRECISIONS)}",
        "model=xvector",
        "device=cpu",
        "trainer.debug=true",
        "trainer.log_interval_steps=1",  # a debug run has 4 optimizer steps
        f"hydra.sweep.dir={sweep_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)


def start_tensorboard(python: str, logdir: Path, port: int) -> subprocess.Popen:
    """``tensorboard --logdir`` on ``logdir``; returns once it answers."""
    process = subprocess.Popen(
        [python, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port)]
        + ["--host", "127.0.0.1", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise RuntimeError("TensorBoard did not start within 60 s")


def browser() -> webdriver.Chrome:
    """Headless Chromium with a laptop-sized window."""
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900"):
        options.add_argument(arg)
    options.binary_location = "/usr/bin/chromium"
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def page_text(driver: webdriver.Chrome, url: str, wait_for: str, timeout_s: float = 60) -> str:
    """The visible text of ``url`` once it contains ``wait_for`` (or after ``timeout_s``)."""
    driver.get(url)
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = driver.execute_script(_ALL_TEXT_JS)
        if wait_for in text:
            time.sleep(2)  # let charts and tables finish rendering
            return driver.execute_script(_ALL_TEXT_JS)
        time.sleep(1)
    return text


def visible_runs(driver: webdriver.Chrome, page: str, column: str | None = None) -> list[str]:
    """Failed checks: each precision not visible on screen (a run name or a table cell)."""
    failures = []
    for precision in PRECISIONS:
        needle = f"precision={precision}" if column is None else precision
        hits = driver.execute_script(_VISIBLE_JS, needle)
        print(f"{page}: {needle!r} in {len(hits)} texts, visible in", end=" ")
        print(sum(hit["visible"] for hit in hits))
        if not any(hit["visible"] for hit in hits):
            failures.append(f"{page}: {needle} not visible")
    if column is not None and not any(
        hit["visible"] for hit in driver.execute_script(_VISIBLE_JS, column)
    ):
        failures.append(f"{page}: no {column} column visible")
    return failures


def check(sweep_dir: Path, python: str, out: Path) -> list[str]:
    """Screenshots into ``out``; returns the failed checks (empty: all passed)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    tensorboard = start_tensorboard(python, sweep_dir, port)
    failures: list[str] = []
    driver = browser()
    try:
        base = f"http://127.0.0.1:{port}/"
        text = page_text(driver, base + "#timeseries", "precision=bf16")
        driver.save_screenshot(str(out / "timeseries.png"))
        (out / "timeseries.txt").write_text(text)
        failures += visible_runs(driver, "Time Series")
        # Tag groups; their charts render lazily (when scrolled to), so check the groups.
        for group in ("train", "valid", "epoch", "test"):
            if group not in text.split("\n"):
                failures.append(f"Time Series: no {group} group")

        text = page_text(driver, base + "?tagFilter=test#timeseries", "test/")
        driver.save_screenshot(str(out / "timeseries_test.png"))
        (out / "timeseries_test.txt").write_text(text)
        for tag in ("test/accuracy_percent", "test/loss"):
            if "/" + tag.split("/")[1] not in text.split("\n"):
                failures.append(f"Time Series: no {tag} chart")

        text = page_text(driver, base + "#hparams", "bf16")
        driver.save_screenshot(str(out / "hparams.png"))
        (out / "hparams.txt").write_text(text)
        failures += visible_runs(driver, "HParams", column="precision")
    finally:
        driver.quit()
        tensorboard.terminate()
        tensorboard.wait(timeout=30)
    return failures


def main() -> int:
    """Parse the arguments, run the sweep if needed, check, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--sweep-dir", type=Path, help="a finished sweep to look at")
    parser.add_argument("--out", type=Path, default=Path("tensorboard_check"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sweep_dir = args.sweep_dir
        if sweep_dir is None:
            sweep_dir = Path(tmp) / "sweep"
            run_sweep(args.python, sweep_dir)
        failures = check(sweep_dir, args.python, args.out)
    for failure in failures:
        print("FAILED:", failure)
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
