"""qwen_trt.bench.worker_speed on the tiny model (CPU, the batched runner): the engine process's
load stages and the client-vs-engine comparison produce their keys, and the client's greedy
replies are token for token the in-process runner's."""
from __future__ import annotations

import json

from qwen_trt.bench import worker_speed


def test_worker_speed_json(tiny_model_dir, tmp_path):
    out = tmp_path / "ws.json"
    assert worker_speed.main(["--model", str(tiny_model_dir), "--device", "cpu", "--fast", "on",
                              "--concurrency", "1,3", "--prompt-len", "24", "--new-tokens", "8",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    load = res["load"]
    assert load["ready_s"] > 0 and load["timings"]["ready_s"] > 0
    assert {"import_s", "load_and_warmup_s", "runner_s", "total_s"} <= set(load["timings"])
    lines = [s["line"] for s in load["stages"]]
    assert any("loading the model" in s for s in lines) and any("ready in" in s for s in lines)
    assert [s["t_s"] for s in load["stages"]] == sorted(s["t_s"] for s in load["stages"])
    assert res["engine"]["backend"] == "torch-fast" and res["engine"]["max_concurrency"] > 1
    assert [r["concurrency"] for r in res["levels"]] == [1, 3]
    for row in res["levels"]:
        n = row["concurrency"]
        c, s, p = row["client"], row["step_timer"], row["in_process"]
        assert c["tokens"] == p["tokens"] == n * 8 and c["finish"] == ["length"]
        # a prefill step, then one decode step per further token (nothing else ran meanwhile)
        assert 8 <= s["steps"] <= 8 + n and s["step_s"] > 0
        assert 0 < c["output_tok_s"] and 0 < s["output_tok_s"] and 0 < p["output_tok_s"]
        assert row["client_over_step_timer"] == round(c["output_tok_s"] / s["output_tok_s"], 4)
        assert row["client_over_in_process"] == round(c["output_tok_s"] / p["output_tok_s"], 4)
        # float32 greedy: the same requests give the same tokens with or without the process
        assert row["same_tokens"] == n
    assert res["in_process_load_s"] > 0


def test_the_worker_times_each_request_from_the_pipe_to_its_first_token():
    """serve() stamps a request when it takes it off the pipe and reports the time to its first
    token's send in the stats (``first_token_ms``); requests that fail before a token are not
    counted."""
    from qwen_trt.backends.runner import RunnerStats, TokenEvent
    from qwen_trt.serving.worker import serve

    class Runner:
        def __init__(self):
            self.todo, self.steps = [], 0

        def add(self, rid, ids, params):
            if rid == 2:
                raise ValueError("too long")
            self.todo.append(rid)

        def abort(self, rid):
            pass

        def has_work(self):
            return bool(self.todo)

        def step(self):
            self.steps += 1
            out = [TokenEvent(r, (7,), finish="length" if self.steps > 1 else None)
                   for r in self.todo]
            if self.steps > 1:
                self.todo = []
            return out

        def stats(self):
            return RunnerStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=1,
                               prefix_hit_tokens=0, prompt_tokens=0)

    class Conn:
        def __init__(self):
            self.inbox = [("submit", 1, [1, 2], None), ("submit", 2, [1], None),
                          ("submit", 3, [4], None)]
            self.sent = []

        def poll(self):
            return bool(self.inbox)

        def recv(self):
            return self.inbox.pop(0) if self.inbox else ("stop",)

        def send(self, msg):
            self.sent.append(msg)

    conn = Conn()
    serve(conn, Runner())
    stats = [m[2] for m in conn.sent if m[0] == "events" and m[2] is not None]
    first = stats[-1]["worker"]["first_token_ms"]
    assert first["n"] == 2 and 0 <= first["p50"] <= first["p90"]
