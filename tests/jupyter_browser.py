"""Drive a real JupyterLab in headless Chromium, for tests that must see what a learner sees.

    with JupyterLabServer(root_dir, env={"TITANLITE_SMOKE": "1"}) as lab, LabBrowser() as browser:
        page = browser.new_page()
        open_notebook(page, lab, "notebooks/01_baseline_training.ipynb")
        run_all_cells(page)
        snap = wait_until_done(page, timeout_s=150)   # prompts, outputs, kernel status

Everything the server and kernels write (settings, workspaces, runtime files, IPython
profile) goes into a scratch folder, so a run leaves nothing in $HOME or the repository, and a
user's own kernelspecs or startup files cannot change what is tested.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("TITANLITE_CHROMIUM", "/usr/bin/chromium")
# Root in a container has no user namespaces for the sandbox; the rest stop Chromium from
# phoning home (there is no network) and from doing GPU work there is no GPU for.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
# windowingMode "none": JupyterLab otherwise detaches off-screen cells from the DOM, and the
# test must see every cell's prompt and output. No news/update checks: there is no network.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


def browser_missing() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is missing: pip install playwright"
    if not Path(CHROMIUM).exists():
        return (
            f"no Chromium at {CHROMIUM}: apt-get install chromium "
            "(or set TITANLITE_CHROMIUM to a Chromium binary)"
        )
    return None


class JupyterLabServer:
    """`jupyter lab` on a free localhost port with a random token, run by this interpreter (so
    its kernels are this venv's python), shut down with all its kernels on exit."""

    def __init__(self, root_dir, env: dict | None = None, scratch=None, startup_timeout_s=90):
        self.root_dir = Path(root_dir)
        self.scratch = Path(scratch or self.root_dir.parent / "jupyter-scratch")
        # Port 0: the server binds one the kernel picks and writes it to its runtime file. (A port
        # picked here and bound by the server seconds later could be taken meanwhile on a busy
        # machine, as the launcher's once was.)
        self.port, self.token = None, secrets.token_hex(16)
        self.startup_timeout_s = startup_timeout_s
        self.extra_env = env or {}
        self.proc = None
        self.log_path = self.scratch / "jupyter-lab.log"

    def _env(self) -> dict:
        env = dict(os.environ)
        # Kernels should see what a learner's do: the automatic LivePlot mode, and matplotlib's
        # inline backend rather than the Agg that CI and conftest set for headless tests.
        for name in ("TITANLITE_LIVE_PLOT", "MPLBACKEND", "JPY_SESSION_NAME"):
            env.pop(name, None)
        for name in ("config", "data", "runtime", "ipython"):
            (self.scratch / name).mkdir(parents=True, exist_ok=True)
        env.update(
            JUPYTER_CONFIG_DIR=str(self.scratch / "config"),
            JUPYTER_DATA_DIR=str(self.scratch / "data"),
            JUPYTER_RUNTIME_DIR=str(self.scratch / "runtime"),
            IPYTHONDIR=str(self.scratch / "ipython"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        )
        env.update(self.extra_env)
        return env

    def start(self) -> JupyterLabServer:
        settings = self.scratch / "settings"
        for rel, values in LAB_SETTINGS.items():
            (settings / rel).parent.mkdir(parents=True, exist_ok=True)
            (settings / rel).write_text(json.dumps(values))
        cmd = [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            "--ServerApp.port=0",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root_dir}",
            f"--LabApp.user_settings_dir={settings}",
            f"--LabApp.workspaces_dir={self.scratch / 'workspaces'}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            "--ServerApp.terminals_enabled=False",
        ]
        if os.geteuid() == 0:  # CI containers run as root; jupyter refuses without this
            cmd.append("--allow-root")
        # Port 0 narrows the race for a port to the server's own bind-read-close-listen (jupyter
        # does that itself); should another process still win it, the server exits and we retry.
        for _ in range(3):
            if self._launch(cmd):
                return self
        raise RuntimeError(f"jupyter lab found its port taken 3 times:\n{self.log_tail()}")

    def _launch(self, cmd) -> bool:
        """Start the server; True once it answers, False if it exited at once on a taken port."""
        for stale in (self.scratch / "runtime").glob("jpserver-*"):  # a killed server's, ours
            stale.unlink()
        self.port = None
        log = open(self.log_path, "wb")
        # Own session (process group): on exit we can signal the server and every kernel it
        # started, and nothing outlives the test.
        self.proc = subprocess.Popen(
            cmd,
            env=self._env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "already in use" in self.log_tail():
                    return False
                raise RuntimeError(
                    f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                self.port = self.port or self._bound_port()
                self.api("status")
                return True
            except (OSError, ValueError, KeyError):  # not bound yet, or its file half written
                time.sleep(0.3)
        raise RuntimeError(
            f"jupyter lab did not answer in {self.startup_timeout_s}s:\n{self.log_tail()}"
        )

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _bound_port(self) -> int:
        # Its runtime folder is this server's alone (jupyter_core may exec a child: any pid).
        (info,) = (self.scratch / "runtime").glob("jpserver-*.json")
        port = int(json.loads(info.read_text())["port"])
        if port == 0:  # older jupyter_servers wrote the port asked for (jupyter-server#1650)
            raise RuntimeError(f"{info} says port 0: upgrade jupyter_server (2.21 works)")
        return port

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(
            f"{self.base}/api/{path}",
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            body = r.read()
        return json.loads(body) if body else None

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}?token={self.token}&reset"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:  # polite first: the server shuts its kernels down cleanly (once we know its port)
            if self.port:
                self.api("shutdown", method="POST")
                self.proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # our own process group only
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # kernels that ignored the shutdown are still in our group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class LabBrowser:
    """Headless Chromium through Playwright; closes the browser and its driver on exit."""

    def __init__(self, viewport=(1400, 1000)):
        self.viewport = viewport
        self._pw = self.browser = None

    def start(self) -> LabBrowser:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        try:
            self.browser = self._pw.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
        except BaseException:
            self._pw.stop()
            raise
        return self

    def new_page(self):
        w, h = self.viewport
        return self.browser.new_page(viewport={"width": w, "height": h})

    def stop(self) -> None:
        try:
            if self.browser is not None:
                self.browser.close()
        finally:
            if self._pw is not None:
                self._pw.stop()
            self.browser = self._pw = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def open_notebook(page, lab: JupyterLabServer, path: str, timeout_s: float = 90) -> None:
    """Load JupyterLab on `path` (relative to the server root) and wait for an idle kernel."""
    page.goto(lab.url(f"lab/tree/{path}"), timeout=timeout_s * 1000)
    page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell", timeout=timeout_s * 1000)
    accept_kernel_dialog(page)
    page.wait_for_selector(
        '.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=timeout_s * 1000
    )


def accept_kernel_dialog(page, wait_ms: int = 1500) -> None:
    """A notebook without kernelspec metadata asks which kernel to use: take the default."""
    try:
        page.wait_for_selector(".jp-Dialog", timeout=wait_ms)
    except Exception:
        return
    page.click(".jp-Dialog .jp-mod-accept")


# Run All has started once some prompt leaves "[ ]"; before that, "idle" means nothing.
STARTED_JS = """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-InputArea-prompt')]
                         .some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))"""


def run_all_cells(page, started_timeout_s: float = 45) -> None:
    """Run ▸ Run All Cells, through the menu bar as a learner would, and wait until a cell is
    queued. On a loaded machine a starved browser once dropped the click (no prompt changed in
    30 s): the menu is used again, only when no cell was queued, so nothing runs twice."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(2):
        page.click('.lm-MenuBar-itemLabel:text-is("Run")')
        page.click('.lm-Menu-itemLabel:text-is("Run All Cells")')
        try:
            page.wait_for_function(STARTED_JS, timeout=started_timeout_s * 1000)
            return
        except PlaywrightTimeout:
            if attempt:
                raise
            page.keyboard.press("Escape")  # close the menu if it is still open


# One snapshot of the notebook: each code cell's prompt ("[*]:", "[3]:", "[ ]:") and text of
# its outputs, plus the kernel status from the toolbar's execution indicator.
SNAPSHOT_JS = """() => {
  const cells = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')];
  const indicator = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator')
      || document.querySelector('.jp-Notebook-ExecutionIndicator');
  return {
    status: indicator ? indicator.getAttribute('data-status') : null,
    cells: cells.map(c => ({
      prompt: (c.querySelector('.jp-InputArea-prompt') || {}).textContent || '',
      empty: ((c.querySelector('.jp-InputArea-editor') || {}).textContent || '').trim() === '',
      stderr: [...c.querySelectorAll('.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]')]
                .map(e => e.textContent),
      text: (c.querySelector('.jp-OutputArea') || {}).textContent || '',
    })),
  };
}"""


def snapshot(page) -> dict:
    return page.evaluate(SNAPSHOT_JS)


def wait_until_done(page, timeout_s: float, settle_s: float = 2.0) -> dict:
    """Poll until no cell is queued or running and the kernel is idle for `settle_s` (Run All
    queues cells one after another, so a single idle glimpse between two cells is not enough)."""
    deadline, idle_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        snap = snapshot(page)
        if snap["status"] == "dead":
            return snap  # the caller reports it; waiting longer cannot help
        busy = snap["status"] != "idle" or any("*" in c["prompt"] for c in snap["cells"])
        if busy:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= settle_s:
            return snap
        time.sleep(0.25)
    raise TimeoutError(
        f"notebook still running after {timeout_s:.0f}s: {summarize(snapshot(page))}"
    )


def summarize(snap: dict) -> str:
    return f"kernel {snap['status']}, prompts {[c['prompt'] for c in snap['cells']]}"
