#!/usr/bin/env python
"""Smoke test of the real SGLang server on CPU with the tiny Qwen3 checkpoints.

Run with the venv `setup.sh` made:  ~/.cache/rollout-buffer/real-sglang/current/venv/bin/python real_sglang/smoke.py

Steps: start server (own process group) -> wait for /health (bounded) -> greedy /generate of 16 tokens with
log-probs -> compare with a transformers float32 forward -> /update_weights_from_disk to checkpoint B and
check meta_info.weight_version changes (and the outputs change to B's) -> kill the process group.
Prints one SUMMARY line (also written as JSON to <build>/logs/smoke_summary.json). Exit 0 on success.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import requests

HERE = os.path.dirname(os.path.abspath(__file__))
LAB = os.path.join(os.environ.get("RB_REAL_SGLANG_HOME", os.path.expanduser("~/.cache/rollout-buffer/real-sglang")),
                   "current")
PY = sys.executable
PROMPT_IDS = [9707, 11, 1879, 0, 576, 3974, 13876, 38835]  # "Hello, world! The quick brown fox" (Qwen3 tokenizer)


def reference(forward, model_dir, output_ids):
    """The output tokens' log-probs from a transformers float32 forward, and its greedy ids."""
    tokens = PROMPT_IDS + list(output_ids)
    dist = forward.distributions(forward.load(model_dir), tokens)[len(PROMPT_IDS) - 1:]
    return dist.gather(1, forward.torch.tensor(output_ids)[:, None])[:, 0].tolist(), dist.argmax(-1).tolist()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def group_rss_mb(pgid):
    """Sum RSS (MiB) of all live processes in the process group."""
    total = 0
    procs = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == "Z":  # fields[2] = pgrp, fields[0] = state
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        procs += 1
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return total / 1024.0, procs


def kill_group(proc, pgid):
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        t0 = time.time()
        while time.time() - t0 < wait:
            proc.poll()
            if group_rss_mb(pgid)[1] == 0:
                return
            time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model-a", default=os.path.join(LAB, "models", "tiny-qwen3-a"))
    ap.add_argument("--model-b", default=os.path.join(LAB, "models", "tiny-qwen3-b"))
    ap.add_argument("--ready-timeout", type=float, default=420)
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    os.makedirs(os.path.join(LAB, "logs"), exist_ok=True)
    log_path = os.path.join(LAB, "logs", f"smoke_server_{port}.log")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    cmd = [PY, "-m", "sglang.launch_server", "--model-path", args.model_a, "--device", "cpu",
           "--attention-backend", "torch_native", "--disable-overlap-schedule", "--dtype", "float32",
           "--max-total-tokens", "8192", "--mem-fraction-static", "0.05",
           "--host", "127.0.0.1", "--port", str(port), "--sleep-on-idle"]
    print("[smoke] launching:", "SGLANG_USE_CPU_ENGINE=1", " ".join(cmd), flush=True)
    print("[smoke] server log:", log_path, flush=True)
    t0 = time.time()
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    pgid = proc.pid
    summary = {"ok": False, "port": port}
    try:
        # ---- wait for readiness (bounded) ----
        ready = None
        while time.time() - t0 < args.ready_timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early with code {proc.returncode}; see {log_path}")
            try:
                if requests.get(base + "/health", timeout=3).status_code == 200:
                    ready = time.time() - t0
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        if ready is None:
            raise RuntimeError(f"server not ready within {args.ready_timeout}s; see {log_path}")
        summary["ready_s"] = round(ready, 1)
        print(f"[smoke] ready after {ready:.1f}s", flush=True)

        def gen(n=16):
            body = {"input_ids": PROMPT_IDS, "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
            t = time.time()
            r = requests.post(base + "/generate", json=body, timeout=120)
            dt = time.time() - t
            r.raise_for_status()
            return r.json(), dt

        # ---- greedy generate 16 tokens with log-probs ----
        gen(2)  # warm-up (first request pays lazy init); timed request below
        out, dt = gen(16)
        summary["generate_16_s"] = round(dt, 3)
        mi = out["meta_info"]
        otl = mi["output_token_logprobs"]
        assert len(out["output_ids"]) == 16 and len(otl) == 16, (len(out["output_ids"]), len(otl))
        assert all(len(e) == 3 and e[2] is None and e[1] == tid
                   for e, tid in zip(otl, out["output_ids"], strict=True)), otl[:2]
        eng_lp = [e[0] for e in otl]
        print(f"[smoke] generate 16 tokens: {dt:.3f}s ids={out['output_ids']}", flush=True)
        print(f"[smoke] meta_info keys: {sorted(mi)}  weight_version={mi.get('weight_version')!r}", flush=True)

        # ---- transformers reference ----
        sys.path.insert(0, HERE)
        import forward_logprobs as forward
        t = time.time()
        ref_lp, ref_argmax = reference(forward, args.model_a, out["output_ids"])
        maxdiff = max(abs(a - b) for a, b in zip(eng_lp, ref_lp, strict=True))
        summary["reference_s"] = round(time.time() - t, 2)
        summary["max_abs_logprob_diff"] = maxdiff
        summary["greedy_matches_hf_argmax"] = ref_argmax == out["output_ids"]
        print(f"[smoke] max |engine - transformers| log-prob = {maxdiff:.3e}; greedy==HF argmax: "
              f"{summary['greedy_matches_hf_argmax']}", flush=True)

        # ---- weight update to checkpoint B ----
        v_before = mi.get("weight_version")
        t = time.time()
        r = requests.post(base + "/update_weights_from_disk",
                          json={"model_path": args.model_b, "weight_version": "ckpt-b"}, timeout=300)
        summary["update_weights_s"] = round(time.time() - t, 2)
        upd = r.json()
        print(f"[smoke] update_weights_from_disk -> {r.status_code} {upd}", flush=True)
        assert r.status_code == 200 and upd.get("success") is True, upd
        out_b, _ = gen(16)
        v_after = out_b["meta_info"].get("weight_version")
        summary["weight_version"] = [v_before, v_after]
        assert v_after != v_before and v_after == "ckpt-b", (v_before, v_after)
        ref_b, _ = reference(forward, args.model_b, out_b["output_ids"])
        maxdiff_b = max(abs(e[0] - b) for e, b in zip(out_b["meta_info"]["output_token_logprobs"], ref_b, strict=True))
        summary["max_abs_logprob_diff_after_update"] = maxdiff_b
        summary["outputs_changed_after_update"] = out_b["output_ids"] != out["output_ids"]
        print(f"[smoke] after update: weight_version {v_before!r} -> {v_after!r}; ids={out_b['output_ids']}; "
              f"max diff vs HF(ckpt B) = {maxdiff_b:.3e}", flush=True)

        rss, nproc = group_rss_mb(pgid)
        summary["server_rss_mb"] = round(rss, 1)
        summary["server_procs"] = nproc
        assert maxdiff <= args.tol and maxdiff_b <= args.tol, (maxdiff, maxdiff_b)
        summary["ok"] = True
    except Exception as e:  # report and fall through to cleanup
        summary["error"] = f"{type(e).__name__}: {e}"
    finally:
        t = time.time()
        kill_group(proc, pgid)
        logf.close()
        summary["shutdown_s"] = round(time.time() - t, 1)
        summary["leftover_procs"] = group_rss_mb(pgid)[1]
        summary["total_s"] = round(time.time() - t0, 1)
    with open(os.path.join(LAB, "logs", "smoke_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("SUMMARY " + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
