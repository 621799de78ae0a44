"""Starts one real gateway with two CPU rank processes for the whole session, and stops them.

The gateway runs with `--api-key` (so auth is exercised), a small body limit, and the
test-only scripted replay on the ranks (env MINIMAX_TEST_REPLAY + MINIMAX_ALLOW_TEST_HOOKS=1,
inherited by the ranks it spawns) so tool-call and reasoning output is exercised end to end.
"""

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
API_KEY = "e2e-secret"
BODY_LIMIT = 1 << 20

REPLAY = {
    "scripts": [
        {
            "trigger": "REPLAY:tools",
            "text": "The user wants the weather in Paris.</think>\n\nLet me check.\n"
            "<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
            "<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">3</parameter>\n"
            "</invoke>\n</minimax:tool_call>",
        },
        {
            "trigger": "REPLAY:reason",
            "text": "Two plus two is four.\nNo doubt.</think>\n\nThe answer is 4. Ünïcödé 🎉 done.",
        },
        {"trigger": "REPLAY:stop", "text": "r</think>\n\nalpha beta STOP gamma delta"},
        # Structured outputs: the reasoning block is scripted, the document is sampled (masked).
        {"trigger": "REPLAY:json", "text": "ok</think>\n\n", "then": "sample"},
        # Guided tool calls: the block is opened by the script, its inside is sampled (masked).
        {"trigger": "REPLAY:call", "text": "ok</think>\n\n<minimax:tool_call>", "then": "sample"},
        {
            "trigger": "REPLAY:patch",
            "text": "Add the file.</think>\n\n<minimax:tool_call>\n<invoke name=\"apply_patch\">\n"
            "<parameter name=\"input\">*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n</parameter>\n"
            "</invoke>\n</minimax:tool_call>",
        },
    ]
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base, proc, log_path):
        self.base = base
        self.url = base + "/v1"
        self.proc = proc
        self.log_path = log_path
        self.api_key = API_KEY
        self.body_limit = BODY_LIMIT
        host, port = base.replace("http://", "").split(":")
        self.host, self.port = host, int(port)

    def metrics(self):
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()


@pytest.fixture(scope="session")
def server():
    gateway = os.environ.get("MINIMAX_E2E_GATEWAY", os.path.join(ROOT, "target/debug/minimax-gateway"))
    rank = os.environ.get("MINIMAX_E2E_RANK", os.path.join(ROOT, "target/debug/minimax-rank"))
    tmp = tempfile.mkdtemp(prefix="minimax-e2e-")
    replay = os.path.join(tmp, "replay.json")
    with open(replay, "w") as f:
        json.dump(REPLAY, f)
    port = free_port()
    env = dict(os.environ)
    env.update(
        {
            "MINIMAX_ALLOW_TEST_HOOKS": "1",
            "MINIMAX_TEST_REPLAY": replay,
            "MINIMAX_API_KEY": API_KEY,
            "RUST_LOG": env.get("RUST_LOG", "info"),
            "NO_COLOR": "1",
        }
    )
    log_path = os.path.join(tmp, "gateway.log")
    log = open(log_path, "w")
    cmd = [
        gateway,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--world-size", "2",
        "--device", "cpu",
        "--rank-binary", rank,
        "--run-dir", os.path.join(tmp, "run"),
        "--max-body-bytes", str(BODY_LIMIT),
        "--request-timeout", "300",
        "--max-queue", "256",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    ready = False
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    ready = True
                    break
        except Exception:
            pass
        time.sleep(0.5)
    if not ready:
        proc.kill()
        log.close()
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        pytest.fail(f"gateway did not become ready in 180 s:\n{tail}")
    srv = Server(base, proc, log_path)
    try:
        yield srv
    finally:
        # The gateway stops the ranks it spawned on SIGTERM; kill the group if it hangs.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120)
