#!/usr/bin/env bash
# Rank failure and recovery through the real gateway, end to end over the OpenAI-compatible
# HTTP API (python3 standard library only):
#   1. a gateway with ONE rank serves a greedy chat completion: the reference text;
#   2. a gateway with TWO ranks (tensor parallel) must serve the same text;
#   3. a long streamed completion; after a few tokens one rank gets SIGKILL: the stream must
#      end with an error event (rank_failure), not hang;
#   4. the supervisor restarts every rank (a new NCCL unique id on GPUs); the next request must
#      be served and give the reference text again. Recovery = kill -> that answer complete.
#   Trials kill rank 1, then rank 0 (the head). Prints a table; logs go to $OUT (or a temp dir).
#
#   tools/gpu/recovery.sh [--device cpu|cuda] [--bin DIR] [--model GGUF] [--tokens N]
#
# --device cuda uses --gpus 0 and --gpus 0,1 (one GPU per rank, NCCL between them); cpu
# uses --world-size 1 / 2 --device cpu (the CPU test transport), to test this script anywhere.
# DIR holds minimax-gateway and minimax-rank (default target/release). The rank processes
# inherit this environment: NCCL_* variables (NCCL_DEBUG, NCCL_P2P_DISABLE, ...) reach them.
set -uo pipefail
cd "$(dirname "$0")/../.."
device=cpu
bin=target/release
model=fixtures/m2-small/q8_0.gguf
tokens=24
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out=${OUT:-$(mktemp -d /tmp/minimax-recovery.XXXXXX)}
mkdir -p "$out"
# Same KV precision on one and two GPUs (the comparison is of greedy text).
export MINIMAX_CUDA_KV_DTYPE=${MINIMAX_CUDA_KV_DTYPE:-f32}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export RUST_LOG=${RUST_LOG:-info} NO_COLOR=1
echo "recovery test: device $device, binaries $bin, model $model, logs $out"
exec env PYTHONUNBUFFERED=1 python3 - "$device" "$bin" "$model" "$out" "$tokens" <<'PY'
import http.client, json, os, signal, subprocess, sys, time

device, bindir, model, out, tokens = sys.argv[1], os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3]), sys.argv[4], int(sys.argv[5])
PROMPT = "Write a long story about two GPUs that talk over NVLink."
failures = []

def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)

def world_args(n):
    if device == "cpu":
        return ["--world-size", str(n), "--device", "cpu", "--parallelism", "tensor"]
    return ["--gpus", ",".join(str(i) for i in range(n)), "--parallelism", "tensor"]

class Gateway:
    def __init__(self, tag, n, port):
        self.port, self.tag = port, tag
        self.log_path = os.path.join(out, f"gateway-{tag}.log")
        log = open(self.log_path, "w")
        cmd = [os.path.join(bindir, "minimax-gateway"), "--model", model, "--port", str(port),
               "--rank-binary", os.path.join(bindir, "minimax-rank"), "--page-size", "16",
               "--restart-backoff-max", "2", *world_args(n)]
        print("$ " + " ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def health(self):
        try:
            c = self.conn(2); c.request("GET", "/health"); r = c.getresponse(); body = r.read(); c.close()
            return r.status, body
        except OSError:
            return None, b""

    def wait_ready(self, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"gateway {self.tag} exited ({self.proc.returncode}); see {self.log_path}")
            st, _ = self.health()
            if st == 200:
                return time.time() - t0
            time.sleep(0.05)
        raise SystemExit(f"gateway {self.tag} not ready within {timeout} s; see {self.log_path}")

    def model_id(self):
        c = self.conn(); c.request("GET", "/v1/models"); r = json.loads(c.getresponse().read()); c.close()
        return r["data"][0]["id"]

    def body(self, max_tokens, stream):
        return json.dumps({"model": self.model_id(), "messages": [{"role": "user", "content": PROMPT}],
                           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream})

    def complete(self, max_tokens):
        c = self.conn(120)
        c.request("POST", "/v1/chat/completions", self.body(max_tokens, False), {"Content-Type": "application/json"})
        r = c.getresponse(); data = json.loads(r.read()); c.close()
        if r.status != 200:
            return r.status, data
        m = data["choices"][0]["message"]
        return 200, (m.get("reasoning_content") or "") + (m.get("content") or "")

    def rank_pids(self):
        """rank -> pid of this gateway's minimax-rank children."""
        pids = {}
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                args = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == self.proc.pid and b"serve" in args and b"--rank" in args:
                pids[int(args[args.index(b"--rank") + 1])] = int(p)
        return pids

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL); self.proc.wait()

def grep(path, *needles):
    import re
    try:
        lines = re.sub(r"\x1b\[[0-9;]*m", "", open(path, errors="replace").read()).splitlines()
    except OSError:
        return []
    return [l for l in lines if any(n in l for n in needles)]

rows = []
base_port = 18400 + os.getpid() % 1000

# 1. One rank: the reference.
g1 = Gateway("1rank", 1, base_port)
try:
    up1 = g1.wait_ready(300)
    st, ref = g1.complete(tokens)
    check(st == 200 and len(ref) > 0, f"1 rank: greedy completion served (ready in {up1:.1f} s)")
    print(f"  reference text: {ref!r}")
finally:
    g1.stop()

# 2. Two ranks (tensor parallel): same text.
g2 = Gateway("2rank", 2, base_port + 1)
try:
    up2 = g2.wait_ready(300)
    st, text = g2.complete(tokens)
    check(st == 200 and text == ref, f"2 ranks (tensor): greedy text equals 1 rank's (ready in {up2:.1f} s)")
    if text != ref:
        print(f"  2-rank text: {text!r}")

    # 3./4. Kill a rank mid-stream, then recover.
    for victim in (1, 0):
        pids = g2.rank_pids()
        check(sorted(pids) == [0, 1], f"trial rank {victim}: found both ranks ({pids})")
        if victim not in pids:
            break
        c = g2.conn(60)
        c.request("POST", "/v1/chat/completions", g2.body(4000, True), {"Content-Type": "application/json"})
        r = c.getresponse()
        check(r.status == 200, f"trial rank {victim}: stream started (HTTP {r.status})")
        seen, t_kill, t_end, ending = 0, None, None, "eof"
        try:
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    ending = "[DONE]"; break
                ev = json.loads(payload)
                if "error" in ev:
                    ending = "error: " + str(ev["error"].get("code")) + ": " + ev["error"].get("message", "")[:160]; break
                seen += 1
                if seen == 8 and t_kill is None:
                    os.kill(pids[victim], signal.SIGKILL)
                    t_kill = time.time()
        except (OSError, http.client.HTTPException) as e:
            ending = f"connection: {e!r}"
        t_end = time.time()
        c.close()
        if t_kill is None:
            check(False, f"trial rank {victim}: stream ended before the kill ({ending})"); break
        t_fail = t_end - t_kill
        check(ending.startswith("error: rank_failure"), f"trial rank {victim}: the stream ended with a rank_failure error event ({ending})")
        check(t_fail < 30, f"trial rank {victim}: the failed request ended {t_fail:.2f} s after the kill (no hang)")
        # Recovery: both ranks are new processes and /health is 200, then a request served.
        t_ready = None
        while time.time() - t_kill < 300:
            new = g2.rank_pids()
            fresh = sorted(new) == [0, 1] and not set(new.values()) & set(pids.values())
            if fresh and g2.health()[0] == 200:
                t_ready = time.time(); break
            if g2.proc.poll() is not None:
                break
            time.sleep(0.05)
        check(t_ready is not None, f"trial rank {victim}: the world came back")
        if t_ready is None:
            break
        st, text = g2.complete(tokens)
        t_served = time.time()
        check(st == 200 and text == ref, f"trial rank {victim}: the first request after recovery was served with the reference text")
        if text != ref:
            print(f"  after-recovery text: {text!r}")
        new = g2.rank_pids()
        check(sorted(new) == [0, 1] and not set(new.values()) & set(pids.values()), f"trial rank {victim}: every rank was restarted ({pids} -> {new})")
        rows.append((victim, seen, t_fail, t_ready - t_kill, t_served - t_kill))
finally:
    g2.stop()

log = g2.log_path
aborts = grep(log, "NCCL communicator aborted")
print()
print("== what the logs say ==")
for l in grep(log, "rank world broken", "torn down", "recovered", "NCCL communicator aborted", "world broken:")[:20]:
    print("  " + l[-220:])
print()
print(f"== recovery ({device}, 2 ranks tensor parallel, kill -9 mid-stream) ==")
print(f"{'killed':>7} {'tokens before':>13} {'request failed (s)':>18} {'world ready (s)':>15} {'next request served (s)':>23}")
for v, seen, f, rd, sv in rows:
    print(f"{'rank ' + str(v):>7} {seen:>13} {f:>18.2f} {rd:>15.2f} {sv:>23.2f}")
print(f"(NCCL aborts logged by survivors: {len(aborts)})")
print()
if failures:
    print(f"{len(failures)} check(s) FAILED:")
    for f in failures:
        print("  " + f)
    sys.exit(1)
print("all checks passed")
PY
