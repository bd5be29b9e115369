"""Issue 31's hardening audit against a real ``qserve serve`` on the CPU (the built-in demo model).

Knows: the audit's hostile cases (huge and deep schemas, abandoned compiles, large bodies, SIGTERM
during compiles and streams, KV-events binding, tenant limits and files, remote-code tokenizers,
security headers, a Hypothesis fuzz of the OpenAI routes) and what each must get. Must not know:
qserve's internals: it talks HTTP to servers it starts (``python -m qserve.cli serve`` on free
ports) and runs the CLI, as a user would.

Usage (repository root): ``PYTHONPATH=$PWD python bench/audit/run_audit.py [CASE ...] [--url URL]
[--out results.json]``. Each case records rows (case, expected, observed, pass, timing, 1-minute
load average); ``/health`` latency is measured from a second process while each large request runs,
with the server's RSS growth (its children included). Results: bench/audit_2026-12-05.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.server.test_fuzz's strategies
MODEL = "demo-gptq"
ROWS: list[dict] = []
SERVER_ERRORS: list[str] = []


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, env: dict | None = None, wait: bool = True, name: str = "srv") -> None:
        self.port = free_port()
        self.pid: int | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkdtemp(prefix="audit-")) / f"{name}.log"
        self.log = open(self.log_path, "w")
        cmd = [PY, "-m", "qserve.cli", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=ROOT
        )
        self.pid = self.proc.pid
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 240) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server not ready")

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def sigterm_exit_s(self, limit: float = 60) -> float | None:
        """SIGTERM, then the seconds until the process is gone (None: still alive after limit)."""
        t0 = time.time()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        return time.time() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _rss(pid: int | None) -> int:
    if pid is None:
        return 0
    import psutil

    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
    except psutil.Error:
        return 0


def _probe(url: str, stop, out, pid=None) -> None:  # runs in a child process: the second client
    lat = []
    rss = [_rss(pid)]
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            rss.append(_rss(pid))
            t0 = time.perf_counter()
            try:
                c.get(url + "/health")
            except httpx.HTTPError:
                pass
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)
    out.send((lat, rss[0], max(rss)))


class HealthProbe:
    """/health latency from another process while the block runs."""

    def __init__(self, url: str, pid: int | None = None) -> None:
        self.url = url
        self.pid = pid

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_probe, args=(self.url, self.stop, send, self.pid))
        self.proc.start()
        time.sleep(1.5)  # the child imports httpx
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        lat, self.rss0, self.rss_max = self.recv.recv()
        lat = sorted(lat)
        self.proc.join()
        self.n = len(lat)
        self.max = lat[-1] if lat else float("nan")
        self.p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")

    def summary(self) -> str:
        mem = f"; server RSS +{(self.rss_max - self.rss0) / 2**20:.0f} MiB" if self.rss0 else ""
        return f"/health max {self.max * 1000:.0f} ms, p99 {self.p99 * 1000:.0f} ms ({self.n} probes){mem}"


def row(case: str, expected: str, observed: str, ok: bool, timing: str = "") -> None:
    r = {"case": case, "expected": expected, "observed": observed, "pass": ok, "timing": timing, "load": load()}
    ROWS.append(r)
    print(("PASS " if ok else "FAIL ") + json.dumps(r), flush=True)


def post(client: httpx.Client, path: str, body, **kw) -> tuple[httpx.Response | None, float, str]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.perf_counter()
    try:
        r = client.post(
            path, content=content, headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw
        )
    except httpx.HTTPError as err:
        return None, time.perf_counter() - t0, f"{type(err).__name__}"
    dt = time.perf_counter() - t0
    if r.status_code >= 500:
        SERVER_ERRORS.append(f"{path} {r.status_code} {r.text[:200]}")
    return r, dt, f"{r.status_code} {_err(r)}"


def _err(r: httpx.Response) -> str:
    try:
        e = r.json().get("error")
        return (e.get("message", "")[:110] + (f" [param={e.get('param')}]" if e.get("param") else "")) if e else ""
    except Exception:
        return ""


def schema_body(schema, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "json please"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        **extra,
    }


def enum_schema(n: int, salt: str = "") -> dict:
    return {"type": "object", "properties": {"v": {"enum": [f"{salt}value-{i}" for i in range(n)]}}, "required": ["v"]}


def props_schema(n: int, salt: str = "", required: bool = True) -> dict:
    props = {f"{salt}p{i}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


def timed_case(srv: Server, case: str, expected: str, body, ok_status, path="/v1/chat/completions", limit=30.0):
    with httpx.Client(base_url=srv.url, timeout=120) as c, HealthProbe(srv.url, srv.pid) as probe:
        r, dt, obs = post(c, path, body)
    ok = r is not None and r.status_code in ok_status and dt <= limit and probe.max < 1.0
    row(case, expected, obs, ok, f"{dt:.2f} s; {probe.summary()}")
    return r


# ---------------------------------------------------------------- cases on the default server


def case_big_schemas(srv: Server) -> None:
    exp = "answered or refused < 30 s; /health < 1 s"
    timed_case(srv, "json_schema enum 100k values (1.3 MB)", exp, schema_body(enum_schema(100_000)), {200, 400})
    timed_case(srv, "json_schema 20k properties", exp, schema_body(props_schema(20_000)), {200, 400})
    # under the limits but slow to compile (docs: 2,000 optional properties ~116 s): the timeout's job
    timed_case(
        srv,
        "json_schema 2k optional properties (under limits, slow compile)",
        exp,
        schema_body(props_schema(2_000, "slow", required=False)),
        {200, 400},
    )
    timed_case(
        srv,
        "json_schema 5,000 required properties (at the limit)",
        exp,
        schema_body(props_schema(5_000, "req")),
        {200, 400},
    )
    timed_case(
        srv,
        "guided_json 5,000 required properties (at the limit), completions",
        exp,
        {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": props_schema(5_000, "reqc")},
        {200, 400},
        "/v1/completions",
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": props_schema(5_000, "tool")}}
    timed_case(
        srv,
        "tool_choice required, tool parameters with 5,000 properties",
        exp,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "tools": [tool],
            "tool_choice": "required",
        },
        {200, 400},
    )


def case_abandoned_concurrent(srv: Server) -> None:
    """Ordinary structured requests sent while 8 slow compiles run (clients leave after 5 s / stay)."""
    for patience, label in ((5.0, "abandoned after 5 s"), (60.0, "clients waiting")):
        with HealthProbe(srv.url, srv.pid) as probe:
            salt = f"c{int(patience)}{time.time_ns() % 10**6}"
            threads = [
                threading.Thread(
                    target=_abandon, args=(srv.url, schema_body(props_schema(2_000, f"{salt}-{i}", False)), patience)
                )
                for i in range(8)
            ]
            for t in threads:
                t.start()
            time.sleep(1.0)
            results = []

            def ordinary(i, salt=salt, results=results):
                schema = {
                    "type": "object",
                    "properties": {f"{salt}k{i}": {"type": "integer"}},
                    "required": [f"{salt}k{i}"],
                }
                with httpx.Client(base_url=srv.url, timeout=60) as c:
                    r, dt, obs = post(c, "/v1/chat/completions", schema_body(schema))
                results.append((obs[:60], dt))

            ords = [threading.Thread(target=ordinary, args=(i,)) for i in range(4)]
            for t in ords:
                t.start()
            for t in ords + threads:
                t.join()
        ok = all(o.startswith(("200", "400")) and dt < 30 for o, dt in results) and probe.max < 1.0
        row(
            f"4 ordinary structured requests sent while 8 slow compiles run ({label})",
            "each answered or refused (4xx) < 30 s",
            "; ".join(f"{o} in {dt:.1f}s" for o, dt in results),
            ok,
            probe.summary(),
        )


def _abandon(url: str, body: dict, after: float) -> None:
    try:
        httpx.post(url + "/v1/chat/completions", json=body, timeout=after)
    except httpx.HTTPError:
        pass


def case_abandoned(srv: Server) -> None:
    """Eight expensive structured requests dropped by their clients after 5 s, then ordinary ones."""
    for label, make in (
        ("100k enum", lambda i: schema_body(enum_schema(100_000, f"a{i}"))),
        (
            "2k optional props (compiles slowly, under limits)",
            lambda i: schema_body(props_schema(2_000, f"ab{i}", False)),
        ),
    ):
        with HealthProbe(srv.url, srv.pid) as probe:
            threads = [threading.Thread(target=_abandon, args=(srv.url, make(i), 5.0)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            results = []
            t0 = time.perf_counter()
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                for i in range(4):
                    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                    r, dt, obs = post(c, "/v1/chat/completions", schema_body(schema))
                    results.append((r.status_code if r else None, dt))
            total = time.perf_counter() - t0
        ok = all(s == 200 and dt < 30 for s, dt in results) and probe.max < 1.0
        row(
            f"8 abandoned ({label}) after 5 s, then 4 ordinary structured requests",
            "ordinary ones 200 each < 30 s",
            "; ".join(f"{s} in {dt:.2f}s" for s, dt in results),
            ok,
            f"4 ordinary: {total:.2f} s; {probe.summary()}",
        )


def case_grammar_logit_n(srv: Server) -> None:
    exp = "400 naming the limit (or 200); /health < 1 s"
    rules = "\n".join(f'r{i} ::= "a{i}" | r{i + 1}' for i in range(10_000)) + '\nr10000 ::= "z"'
    timed_case(
        srv,
        "guided_grammar 10k rules",
        exp,
        {**schema_body({}), "response_format": None, "guided_grammar": "root ::= r0\n" + rules},
        {200, 400},
    )
    rules = "\n".join(f'r{i} ::= "a{i}" | r{i + 1}' for i in range(1_990)) + '\nr1990 ::= "z"'
    timed_case(
        srv,
        "guided_grammar 1,990 rules (at the limit)",
        "answered < 30 s; /health < 1 s",
        {**schema_body({}), "response_format": None, "guided_grammar": "root ::= r0\n" + rules},
        {200, 400},
    )
    bias = {str(i): 1.0 for i in range(100_000)}
    timed_case(
        srv, "logit_bias 100k keys", exp, {**schema_body({}), "response_format": None, "logit_bias": bias}, {200, 400}
    )
    bias = {str(i): 1.0 for i in range(1_024)}
    timed_case(
        srv,
        "logit_bias 1,024 keys (at the limit)",
        "200; /health < 1 s",
        {**schema_body({}), "response_format": None, "logit_bias": bias},
        {200},
    )
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"],
    }
    timed_case(
        srv,
        "n=128 guided_json",
        "200; /health < 1 s",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "n": 128,
            "max_tokens": 16,
            "guided_json": schema,
        },
        {200},
        limit=120,
    )
    timed_case(
        srv,
        "completions n=128 guided_json",
        "200; /health < 1 s",
        {"model": MODEL, "prompt": "x", "n": 128, "max_tokens": 16, "guided_json": schema},
        {200},
        "/v1/completions",
        limit=120,
    )


def nest(kind: str, depth: int):
    s = {"type": "string"}
    for _ in range(depth):
        if kind == "object":
            s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
        elif kind == "array":
            s = {"type": "array", "items": s}
        else:
            s = {"anyOf": [s, {"type": "integer"}]}
    return s


def case_deep(srv: Server) -> None:
    exp = "400, no 500"
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for kind in ("object", "array", "anyOf"):
            for field in ("response_format", "guided_json"):
                body = schema_body(nest(kind, 200))
                if field == "guided_json":
                    body = {**body, "response_format": None, "guided_json": nest(kind, 200)}
                r, dt, obs = post(c, "/v1/chat/completions", body)
                row(
                    f"{kind} nested 200 deep ({field})", exp, obs, r is not None and r.status_code == 400, f"{dt:.2f} s"
                )
        pattern = "(" * 5000 + "a" + ")" * 5000
        r, dt, obs = post(c, "/v1/chat/completions", schema_body({"type": "string", "pattern": pattern}))
        row("pattern with 5,000 nested groups", exp, obs, r is not None and r.status_code == 400, f"{dt:.2f} s")
        r, dt, obs = post(
            c, "/v1/chat/completions", {**schema_body({}), "response_format": None, "guided_regex": pattern}
        )
        row("guided_regex with 5,000 nested groups", exp, obs, r is not None and r.status_code == 400, f"{dt:.2f} s")
        for groups in (4_000, 65):
            pattern = "(" * groups + "a" + ")" * groups
            r, dt, obs = post(c, "/v1/chat/completions", schema_body({"type": "string", "pattern": pattern}))
            row(
                f"pattern with {groups:,} nested groups ({len(pattern):,} chars, under the length limit)",
                exp,
                obs,
                r is not None and r.status_code == 400,
                f"{dt:.2f} s",
            )
            pattern = "(?:" * groups + "a" + ")" * groups
            r, dt, obs = post(
                c, "/v1/chat/completions", {**schema_body({}), "response_format": None, "guided_regex": pattern}
            )
            row(
                f"guided_regex with {groups:,} nested (?: groups",
                exp,
                obs,
                r is not None and r.status_code == 400,
                f"{dt:.2f} s",
            )
        # guided_json as a JSON *string* nested 100k deep, on one keep-alive connection
        deep = "[" * 100_000 + "]" * 100_000
        r, dt, obs = post(c, "/v1/chat/completions", {**schema_body({}), "response_format": None, "guided_json": deep})
        r2, _, obs2 = post(
            c,
            "/v1/chat/completions",
            schema_body({"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}),
        )
        deep2 = '{"a":' * 100_000 + "1" + "}" * 100_000
        r3, dt3, obs3 = post(
            c, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": deep2}
        )
        r4, _, obs4 = post(c, "/v1/chat/completions", schema_body({"type": "integer"}))
        ok = (
            r is not None
            and r.status_code == 400
            and r2 is not None
            and r2.status_code == 200
            and r3 is not None
            and r3.status_code == 400
            and r4 is not None
            and r4.status_code == 200
        )
        row(
            'guided_json as a string nested 100k deep ([[..]] chat, {"a":..} completions), then the same keep-alive connection',
            "400, 400, and the next requests on the connection 200",
            f"{obs}; next: {obs2}; {obs3}; next: {obs4}",
            ok,
            f"{dt:.2f} s / {dt3:.2f} s",
        )
        # no 500 from a raw body nested 100k deep either
        r, dt, obs = post(
            c, "/v1/chat/completions", b'{"model":"x","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        )
        row(
            "raw body nested 100k deep", "4xx, no 500", obs, r is not None and 400 <= r.status_code < 500, f"{dt:.2f} s"
        )


def case_unsat(srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for name, schema in (
            ('{"not": {}}', {"not": {}}),
            ("allOf string + integer", {"allOf": [{"type": "string"}, {"type": "integer"}]}),
            ("false schema", False),
            ('"type": []', {"type": []}),
            ("enum []", {"enum": []}),
        ):
            r, dt, obs = post(c, "/v1/chat/completions", schema_body(schema))
            row(f"unsatisfiable schema {name}", "400", obs, r is not None and r.status_code == 400, f"{dt:.2f} s")


def case_bodies(srv: Server) -> None:
    exp = "400 naming the cap; /health < 1 s"
    msgs = json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "w"}] * 470_000}
    ).encode()
    timed_case(srv, f"chat with 470k one-word messages ({len(msgs) / 1e6:.1f} MB)", exp, msgs, {400, 413})
    msgs = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "w"}] * 2048}).encode()
    timed_case(srv, "chat with 2,048 messages (at the cap)", "answered; /health < 1 s", msgs, {200, 400})
    prompts = json.dumps(
        {"model": MODEL, "max_tokens": 1, "prompt": [[i % 500 + 1 for i in range(1000)]] * 3000}
    ).encode()
    timed_case(
        srv, f"3,000 token-id prompts ({len(prompts) / 1e6:.1f} MB)", exp, prompts, {400, 413}, "/v1/completions"
    )
    prompts = json.dumps(
        {"model": MODEL, "max_tokens": 1, "prompt": [[i % 500 + 1 for i in range(1000)]] * 256}
    ).encode()
    timed_case(
        srv,
        "256 token-id prompts x 1,000 ids (at the cap)",
        "answered; /health < 1 s",
        prompts,
        {200, 400},
        "/v1/completions",
        limit=300,
    )
    prompts = json.dumps(
        {"model": MODEL, "max_tokens": 1, "prompt": [[i % 500 + 1 for i in range(40)]] * 3000}
    ).encode()
    timed_case(
        srv,
        f"3,000 token-id prompts x 40 ids ({len(prompts) / 1e6:.1f} MB, under the value cap)",
        exp,
        prompts,
        {400},
        "/v1/completions",
    )
    msgs = json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "w"}] * 90_000}
    ).encode()
    timed_case(srv, f"chat with 90k messages ({len(msgs) / 1e6:.1f} MB, under the value cap)", exp, msgs, {400})
    ids = json.dumps({"model": MODEL, "tokens": [i % 500 + 1 for i in range(2_500_000)]}).encode()
    timed_case(srv, f"/detokenize 2.5M ids ({len(ids) / 1e6:.1f} MB)", exp, ids, {400, 413}, "/detokenize")
    ids = json.dumps({"model": MODEL, "tokens": [i % 500 + 1 for i in range(262_144)]}).encode()
    timed_case(srv, "/detokenize 262,144 ids (at the cap)", "200; /health < 1 s", ids, {200}, "/detokenize")
    big = json.dumps(
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "w " * 8_000_000}]}
    ).encode()
    timed_case(srv, f"one 16 MB message ({len(big) / 1e6:.1f} MB)", "4xx; /health < 1 s", big, {400, 413})


def case_headers(srv: Server) -> None:
    r = httpx.get(srv.url + "/")
    h = r.headers
    ok = (
        r.status_code == 200
        and "frame-ancestors 'none'" in h.get("content-security-policy", "")
        and h.get("x-frame-options") == "DENY"
        and h.get("x-content-type-options") == "nosniff"
    )
    row(
        "security headers on /",
        "CSP, X-Frame-Options DENY, nosniff",
        f"{r.status_code}; CSP={h.get('content-security-policy', '-')[:60]}...; XFO={h.get('x-frame-options')}; nosniff={h.get('x-content-type-options')}",
        ok,
    )
    j = httpx.get(srv.url + "/v1/models").headers.get("x-content-type-options")
    row("nosniff on JSON answers", "nosniff", str(j), j == "nosniff")


# ---------------------------------------------------------------- fuzz


def case_fuzz(srv: Server, examples: int = 300) -> None:
    from hypothesis import strategies as st

    from tests.server import test_fuzz as f

    routes = {
        "/v1/completions": f.COMPLETION | f.ANY,
        "/v1/chat/completions": f.CHAT | f.ANY,
        "/v1/responses": st.fixed_dictionaries(
            {"model": f.MODEL | st.just(MODEL), "input": f.TEXT | st.lists(f.MESSAGE, max_size=2) | f.ANY},
            optional={
                "max_output_tokens": f.SMALL_MAX_TOKENS,
                "instructions": f.TEXT,
                "stream": st.booleans(),
                "text": f.ANY,
                "temperature": f.SCALAR,
            },
        )
        | f.ANY,
        "/v1/embeddings": st.fixed_dictionaries(
            {"model": f.MODEL | st.just(MODEL), "input": f.PROMPT},
            optional={"encoding_format": f.TEXT | st.sampled_from(["float", "base64"]), "dimensions": f.SCALAR},
        )
        | f.ANY,
        "/tokenize": st.fixed_dictionaries(
            {"model": f.MODEL | st.just(MODEL)},
            optional={
                "prompt": f.PROMPT,
                "messages": st.lists(f.MESSAGE, max_size=2) | f.ANY,
                "add_special_tokens": f.SCALAR,
            },
        )
        | f.ANY,
        "/detokenize": st.fixed_dictionaries({"model": f.MODEL | st.just(MODEL), "tokens": f.TOKEN_IDS | f.ANY})
        | f.ANY,
    }
    MODELS = st.just(MODEL)
    # well-formed bodies with hostile sampling fields: they reach the engine
    routes["/v1/completions"] = routes["/v1/completions"] | st.fixed_dictionaries(
        {"model": MODELS, "prompt": f.TEXT | f.TOKEN_IDS, "max_tokens": st.integers(1, 4)}, optional=f.SAMPLING
    )
    routes["/v1/embeddings"] = routes["/v1/embeddings"] | st.fixed_dictionaries(
        {
            "model": MODELS,
            "input": st.text(min_size=1, max_size=20)
            | st.lists(st.integers(0, 2047), min_size=1, max_size=8)
            | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3),
        },
        optional={"encoding_format": st.sampled_from(["float", "base64"])},
    )
    routes["/v1/chat/completions"] = routes["/v1/chat/completions"] | st.fixed_dictionaries(
        {"model": MODELS, "messages": st.lists(f.MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 4)},
        optional={**f.SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(-2, 25), "n": f.SMALL_N},
    )
    structured = st.fixed_dictionaries(
        {"model": MODELS, "prompt": st.just("x"), "max_tokens": st.integers(1, 4)},
        optional={
            "guided_json": f.ANY | f.TEXT,
            "guided_regex": f.TEXT,
            "guided_choice": f.ANY,
            "guided_grammar": f.TEXT,
            "response_format": f.ANY
            | st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": f.ANY}),
                }
            ),
            "logit_bias": st.dictionaries(f.TEXT | st.integers(-5, 10**6).map(str), f.SCALAR, max_size=4),
        },
    )
    routes["/v1/completions (structured fields)"] = structured
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for route, strategy in routes.items():
            t0 = time.perf_counter()
            counts = _fuzz_route(c, route.split(" ")[0], strategy, examples)
            dt = time.perf_counter() - t0
            ok = not counts["5xx"] and not counts["internal"]
            statuses = dict(sorted(counts["status"].items()))
            row(
                f"Hypothesis fuzz {route}",
                "0 5xx",
                f"{counts['n']} bodies, {len(counts['5xx'])} 5xx, {counts['internal']} in-stream internal errors; "
                f"statuses {statuses}" + (f"; first: {counts['5xx'][0][:300]}" if counts["5xx"] else ""),
                ok,
                f"{dt:.1f} s",
            )
            SERVER_ERRORS.extend(counts["5xx"])


def _fuzz_route(c: httpx.Client, path: str, strategy, examples: int) -> dict:
    """POST ``examples`` bodies drawn from ``strategy`` (the same ones every run); count answers."""
    from hypothesis import HealthCheck, given, settings

    counts: dict = {"n": 0, "5xx": [], "internal": 0, "status": {}}

    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def run(body):
        if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] in ("llama", "qwen"):
            body["model"] = MODEL
        if (
            path.startswith(("/v1/completions", "/v1/chat", "/v1/responses"))
            and isinstance(body, dict)
            and not {"max_tokens", "max_output_tokens", "max_completion_tokens"} & set(body)
        ):
            body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 4  # bounded time per case
        text = json.dumps(body, allow_nan=True).encode()
        try:
            r = c.post(path, content=text, headers={"Content-Type": "application/json"})
        except httpx.HTTPError as err:
            counts["5xx"].append(f"transport {type(err).__name__}: {text[:200]!r}")
            return
        counts["n"] += 1
        counts["status"][r.status_code] = counts["status"].get(r.status_code, 0) + 1
        if r.status_code >= 500:
            counts["5xx"].append(f"{r.status_code}: {text[:200]!r} -> {r.text[:200]}")
        if "InternalServerError" in r.text:
            counts["internal"] += 1

    run()
    return counts


# ---------------------------------------------------------------- cases with their own servers


def case_sigterm_compiles() -> None:
    srv = Server(name="sigterm-compiles")
    try:
        bodies = [schema_body(props_schema(2_000, f"st{i}", False)) for i in range(4)]
        threads = [threading.Thread(target=_abandon, args=(srv.url, b, 60)) for b in bodies]
        for t in threads:
            t.start()
        time.sleep(3)
        busy = "compile children: {}".format(
            subprocess.run(["pgrep", "-c", "-P", str(srv.proc.pid)], capture_output=True, text=True).stdout.strip()
        )
        dt = srv.sigterm_exit_s(90)
        for t in threads:
            t.join()
    finally:
        srv.stop()
    row(
        "SIGTERM while 4 slow compiles run",
        "exit < 30 s",
        f"exit code {srv.proc.returncode}; {busy}",
        dt is not None and dt < 30,
        f"{dt:.2f} s" if dt else "alive after 90 s",
    )
    # the issue's exact sequence: 8 abandoned 100k-enum compiles, then SIGTERM
    srv = Server(name="sigterm-abandoned")
    try:
        threads = [
            threading.Thread(target=_abandon, args=(srv.url, schema_body(enum_schema(100_000, f"s{i}")), 5.0))
            for i in range(8)
        ]
        threads += [
            threading.Thread(target=_abandon, args=(srv.url, schema_body(props_schema(2_000, f"sa{i}", False)), 5.0))
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = srv.sigterm_exit_s(90)
    finally:
        srv.stop()
    row(
        "SIGTERM after 16 abandoned expensive structured requests",
        "exit < 30 s",
        f"exit code {srv.proc.returncode}",
        dt is not None and dt < 30,
        f"{dt:.2f} s" if dt else "alive after 90 s",
    )


def _stream(url: str, body: dict, out: list) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass
        out.append(r.status_code)
    except httpx.HTTPError as err:
        out.append(type(err).__name__)


def case_sigterm_defaults() -> None:
    srv = Server(name="sigterm-defaults")
    try:
        out: list = []
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": 8}
        threads = [threading.Thread(target=_stream, args=(srv.url, body, out)) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(3)
        dt = srv.sigterm_exit_s(60)
        for t in threads:
            t.join(5)
    finally:
        srv.stop()
    row(
        "SIGTERM with defaults (--shutdown-timeout 25), 64 long streams in flight",
        "exit <= 25-30 s",
        f"exit code {srv.proc.returncode}; streams: {sorted(map(str, out))[:3]}...",
        dt is not None and dt <= 30,
        f"{dt:.2f} s" if dt else "alive after 60 s",
    )


def case_kv_events() -> None:
    port = free_port()
    srv = Server(
        "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq"}), name="kv-default"
    )
    try:
        httpx.post(
            srv.url + "/v1/completions", json={"model": MODEL, "prompt": "secret " * 40, "max_tokens": 2}, timeout=60
        )
        ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        mine = [ln.split()[3] for ln in ss.splitlines() if f"pid={srv.proc.pid}," in ln]
    finally:
        srv.stop()
    ok = any(a.endswith(":5557") for a in mine) and all(a.startswith(("127.0.0.1:", "[::1]:")) for a in mine)
    row("KV events, default endpoint", "publisher on loopback only (ss)", f"listening: {mine}", ok)
    srv = Server(
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}),
        name="kv-star",
    )
    try:
        ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        mine = [ln.split()[3] for ln in ss.splitlines() if f"pid={srv.proc.pid}," in ln]
        warned = [ln for ln in srv.text().splitlines() if "token ids" in ln.lower() or "warn" in ln.lower()]
    finally:
        srv.stop()
    row(
        "KV events, explicit tcp://*",
        "binds as asked, logs a warning",
        f"listening: {mine}; log: {warned[:1]}",
        bool(warned) and any(a.endswith(f":{port}") for a in mine),
    )


def case_tenants() -> None:
    d = Path(tempfile.mkdtemp(prefix="audit-tenants-"))
    good = d / "tenants.json"
    good.write_text(
        json.dumps(
            {
                "tenants": {
                    "small": {"api_keys": ["sk-small"], "max_concurrent": 3, "max_queued": 0},
                    "capped": {"api_keys": ["sk-capped"], "max_concurrent": 3},
                    "other": {"api_keys": ["sk-other"]},
                }
            }
        )
    )
    srv = Server("--tenants", str(good), "--api-key", "sk-admin", name="tenants")
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            body = {"model": MODEL, "prompt": "x", "n": 1024, "max_tokens": 1}
            r, dt, obs = post(c, "/v1/completions", body, headers={"Authorization": "Bearer sk-small"})
            row(
                "tenant max_concurrent 3 + max_queued 0, one request n=1024",
                "refused (n cap 400 or 429)",
                obs,
                r is not None and r.status_code in (400, 429),
                f"{dt:.2f} s",
            )
            r, dt, obs = post(
                c,
                "/v1/completions",
                {**body, "prompt": ["x"] * 8, "n": 128},
                headers={"Authorization": "Bearer sk-small"},
            )
            row(
                "tenant limited to 3 (max_concurrent 3 + max_queued 0), one request of 8 prompts x n=128 = 1,024 sequences",
                "429 too_large",
                obs,
                r is not None and r.status_code == 429 and "1024 sequences" in obs,
                f"{dt:.2f} s",
            )
            r, dt, obs = post(
                c,
                "/v1/completions",
                {**body, "prompt": "x", "n": 3, "max_tokens": 2},
                headers={"Authorization": "Bearer sk-small"},
            )
            row(
                "same tenant, n=3 (within its limit)", "200", obs, r is not None and r.status_code == 200, f"{dt:.2f} s"
            )
            # only max_concurrent: no queue cap -> admitted; the scheduler must still run at most 3 at once
            peak = [0]
            done = threading.Event()

            def watch():
                while not done.is_set():
                    try:
                        m = httpx.get(
                            srv.url + "/metrics", headers={"Authorization": "Bearer sk-admin"}, timeout=5
                        ).text
                        for ln in m.splitlines():
                            if ln.startswith("vllm:num_requests_running"):
                                peak[0] = max(peak[0], int(float(ln.split()[-1])))
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.05)

            w = threading.Thread(target=watch)
            w.start()
            r, dt, obs = post(
                c, "/v1/completions", {**body, "n": 64, "max_tokens": 4}, headers={"Authorization": "Bearer sk-capped"}
            )
            done.set()
            w.join()
            row(
                "tenant max_concurrent 3 (no max_queued), one request n=64",
                "admitted; at most 3 sequences running",
                f"{obs}; peak vllm:num_requests_running {peak[0]}",
                r is not None and r.status_code == 200 and peak[0] <= 3,
                f"{dt:.2f} s",
            )
            post(
                c,
                "/v1/completions",
                {"model": MODEL, "prompt": "y", "max_tokens": 1},
                headers={"Authorization": "Bearer sk-other"},
            )
            m = c.get("/metrics", headers={"Authorization": "Bearer sk-small"}).text
            tenants_seen = sorted(
                {part.split('tenant="')[1].split('"')[0] for part in m.splitlines() if 'tenant="' in part}
            )
            madmin = c.get("/metrics", headers={"Authorization": "Bearer sk-admin"}).text
            admin_seen = sorted(
                {part.split('tenant="')[1].split('"')[0] for part in madmin.splitlines() if 'tenant="' in part}
            )
            row(
                "tenant key reads /metrics",
                "only its own tenant's series",
                f"tenant sees {tenants_seen}; admin sees {admin_seen}",
                tenants_seen == ["small"] and len(admin_seen) == 3,
            )
            nokey = c.get("/metrics").status_code
            row("/metrics without a key on a keyed server", "401", str(nokey), nokey == 401)
            # /docs on a keyed server
            docs = c.get("/docs")
            spec = c.get("/openapi.json")
            assets = [
                c.get(u).status_code for u in ("/_docs_static/swagger-ui-bundle.js", "/_docs_static/swagger-ui.css")
            ]
            schemes = spec.json().get("components", {}).get("securitySchemes", {}) if spec.status_code == 200 else {}
            tryit = c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                headers={"Authorization": "Bearer sk-admin"},
            ).status_code
            ok = (
                docs.status_code == 200
                and spec.status_code == 200
                and assets == [200, 200]
                and bool(schemes)
                and tryit == 200
            )
            row(
                "/docs on a keyed server",
                "page, assets, openapi.json open; bearer scheme declared for Authorize",
                f"/docs {docs.status_code}, assets {assets}, openapi {spec.status_code}, securitySchemes {list(schemes)}, keyed call {tryit}",
                ok,
            )
    finally:
        srv.stop()
    for label, text in (
        ("weight Infinity", '{"tenants": {"a": {"api_keys": ["k"], "weight": Infinity}}}'),
        ("weight NaN", '{"tenants": {"a": {"api_keys": ["k"], "weight": NaN}}}'),
        ("a key with spaces", '{"tenants": {"a": {"api_keys": ["my key"]}}}'),
        ("weight -Infinity", '{"tenants": {"a": {"api_keys": ["k"], "weight": -Infinity}}}'),
        ("max_concurrent 1e400", '{"tenants": {"a": {"api_keys": ["k"], "max_concurrent": 1e400}}}'),
    ):
        bad = d / "bad.json"
        bad.write_text(text)
        s = Server("--tenants", str(bad), name="badtenants", wait=False)
        t0 = time.time()
        try:
            rc = s.proc.wait(120)
        except subprocess.TimeoutExpired:
            rc = None
        dt = time.time() - t0
        s.stop()
        log = s.text()
        loaded = "ready on" in log or "loading" in log.lower() or "using the cached" in log
        last = [ln for ln in log.splitlines() if ln.strip()][-1:] or [""]
        row(
            f"tenants file with {label}",
            "refused before the model loads",
            f"rc={rc}; {last[0][:140]}",
            rc not in (None, 0) and not loaded,
            f"{dt:.2f} s",
        )


def case_inspect_and_remote_code() -> None:
    demo = Path.home() / ".cache/qserve/demo-gptq"
    d = Path(tempfile.mkdtemp(prefix="audit-ckpt-"))
    notok = d / "no-tokenizer"
    shutil.copytree(demo, notok)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (notok / name).unlink(missing_ok=True)
    r = subprocess.run(
        [PY, "-m", "qserve.cli", "inspect", str(notok)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    out = (r.stdout + r.stderr).strip().splitlines()
    row(
        "qserve inspect on a dir without tokenizer files",
        "nonzero exit naming the tokenizer",
        f"rc={r.returncode}; {(out[-1] if out else '')[:140]}",
        r.returncode != 0 and "tokeniz" in (r.stdout + r.stderr).lower(),
    )
    evil = d / "evil"
    shutil.copytree(demo, evil)
    cfg = json.loads((evil / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "EvilTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (evil / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = d / "code_ran"
    (evil / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    for cmd in (["serve", str(evil), "--port", str(free_port())], ["inspect", str(evil)]):
        rc, output, dt = _on_a_terminal([PY, "-m", "qserve.cli", *cmd], answer=b"y\n", timeout=120)
        asked = "[y/N]" in output or "custom code" in output.lower() and "?" in output
        ok = rc not in (None, 0) and not marker.exists() and not asked
        last = [ln for ln in output.splitlines() if ln.strip()][-1:] or [""]
        row(
            f"auto_map tokenizer on a terminal: qserve {cmd[0]}",
            "refused, no prompt, code not run",
            f"rc={rc}; prompted={asked}; code ran={marker.exists()}; {last[0][:120]}",
            ok,
            f"{dt:.1f} s",
        )


def _on_a_terminal(cmd: list[str], answer: bytes, timeout: float):
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.execvpe(cmd[0], cmd, os.environ)
    t0 = time.time()
    buf = b""
    answered = False
    while time.time() - t0 < timeout:
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            if not answered and b"[y/N]" in buf:
                os.write(fd, answer)
                answered = True
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
    else:
        os.kill(pid, signal.SIGKILL)
    try:
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        rc = None
    return rc, buf.decode(errors="replace"), time.time() - t0


DEFAULT_CASES = {
    "big_schemas": case_big_schemas,
    "abandoned": case_abandoned,
    "abandoned_concurrent": case_abandoned_concurrent,
    "grammar_logit_n": case_grammar_logit_n,
    "deep": case_deep,
    "unsat": case_unsat,
    "bodies": case_bodies,
    "headers": case_headers,
    "fuzz": case_fuzz,
}
OWN_SERVER_CASES = {
    "sigterm_compiles": case_sigterm_compiles,
    "sigterm_defaults": case_sigterm_defaults,
    "kv_events": case_kv_events,
    "tenants": case_tenants,
    "inspect_remote_code": case_inspect_and_remote_code,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=[*DEFAULT_CASES, *OWN_SERVER_CASES])
    ap.add_argument("--url", help="use this running default server instead of starting one")
    ap.add_argument("--out", default="audit_results.json")
    args = ap.parse_args()
    srv = None
    try:
        for name in args.cases:
            print(f"== {name} (load {load()})", flush=True)
            if name in DEFAULT_CASES:
                if srv is None:
                    if args.url:
                        srv = Server.__new__(Server)
                        srv.url = args.url
                        srv.proc = None
                        srv.pid = None
                    else:
                        srv = Server(name="default")
                DEFAULT_CASES[name](srv)
            else:
                OWN_SERVER_CASES[name]()
    finally:
        if srv is not None and srv.proc is not None:
            srv.stop()
        Path(args.out).write_text(json.dumps({"rows": ROWS, "server_errors": SERVER_ERRORS}, indent=1))
        passed = sum(r["pass"] for r in ROWS)
        print(f"{passed}/{len(ROWS)} pass; {len(SERVER_ERRORS)} server errors")


if __name__ == "__main__":
    main()
