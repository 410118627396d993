"""Overhead of tool worker processes (docs/environments.md, "Tool isolation"): start-up, per call, per tools.environment
episode.

python bench/tool_workers.py [CALLS]   (CALLS: timed calls per tool, default 200; starts and episodes: CALLS // 40)
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tools_hostile, imported by test_tools
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "tools"))  # test_tools:Counter

from vlmrl.config import DataConfig, load
from vlmrl.envs import load_env_tasks
from vlmrl.envs.color_square import ColorSquareConfig, ColorSquareEnv, make_tasks
from vlmrl.envs.geometry3k_tools import Geometry3KToolsEnv
from vlmrl.envs.tool_env import ToolEnvFactory
from vlmrl.tools import HermesParser, Tool, ToolLimits, ToolRuntime, calculate, cgroups
from vlmrl.tools.isolation import Sandbox
from vlmrl.tools.process import WorkerProcess
from vlmrl.types import ToolStats

P = HermesParser()
CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
STARTS = max(1, CALLS // 40)


def per_call(rt, tools, text, n=CALLS):
    rt.run(rt.parse(text), tools, ToolStats())
    t0 = time.perf_counter()
    for _ in range(n):
        turn = rt.run(rt.parse(text), tools, ToolStats())
    assert not any(turn.errors), turn.messages
    return (time.perf_counter() - t0) / n * 1e3


t0 = time.perf_counter()
for _ in range(2000):
    calculate("sqrt(3**2+4**2)")
print(f"calculate called in-process: {(time.perf_counter() - t0) / 2000 * 1e3:.3f} ms")
cfg = load("geometry3k_tools_tiny")
task = load_env_tasks(cfg.env, cfg.data)[0]
env = Geometry3KToolsEnv()
env.reset(task)
geo_tools = {t.name: t for t in env.tools()}
t0 = time.perf_counter()
for _ in range(CALLS):
    env.crop(0, 0, 60, 60)
print(f"crop called in-process: {(time.perf_counter() - t0) / CALLS * 1e3:.3f} ms")
print(f"worker cgroup controllers here: {sorted(cgroups.controllers()) or 'none'}")
for iso in ("bwrap", "rlimits"):
    starts = []
    for _ in range(STARTS):
        t = time.perf_counter()
        w = WorkerProcess(Sandbox(isolation=iso))
        w.wait_started()
        starts.append(time.perf_counter() - t)
        w.kill()
    print(f"[{iso}] worker start-up (Popen -> ready), median of {STARTS}: {statistics.median(starts) * 1e3:.0f} ms")
    rt = ToolRuntime(P, ToolLimits(timeout_s=10), sandbox=Sandbox(isolation=iso))
    ms = per_call(
        rt, {"calculate": Tool.from_function(calculate)}, P.format_call("calculate", {"expression": "sqrt(3**2+4**2)"})
    )
    print(f"[{iso}] calculate through the runtime (warm pooled worker): {ms:.2f} ms/call")
    ms = per_call(rt, geo_tools, P.format_call("crop", {"x0": 0, "y0": 0, "x1": 60, "y1": 60}))
    print(f"[{iso}] geometry3k crop (env + diagram sent each call, image back): {ms:.2f} ms/call")
    factory = ToolEnvFactory(ColorSquareEnv, [], "test_tools:Counter", Sandbox(isolation=iso), 10.0)
    (ctask,) = make_tasks(ColorSquareConfig(), DataConfig(limit=1))
    t0 = time.perf_counter()
    for _ in range(STARTS):
        e = factory()
        e.reset(ctask)
        tools = {t.name: t for t in e.tools()}
        rt.run(rt.parse(P.format_call("increment", {"k": 1})), tools, ToolStats())
        e.close()
    print(
        f"[{iso}] tools.environment episode (worker start + new + reset + 1 call + close): "
        f"{(time.perf_counter() - t0) / STARTS * 1e3:.0f} ms"
    )
    rt.executor.close()
