import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"  # tests must never reach a hub
# Never the user's own store; each test also gets a store of its own (the autouse fixture below),
# so a prompt-cache hit left by another test never changes what runs, whatever the order.
os.environ["MEMFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-test-cache-")
# memfit picks torch's thread count from the CPUs free as a run starts (memfit.run.threads); plain diffusers, the
# tests' oracle, computes with torch's own count. Set before torch loads, one count serves both whatever the
# machine's load, so their sums run in the same order and the images compare bitwise.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import pytest  # noqa: E402


from memfit.run.libraries import quiet_libraries  # noqa: E402

quiet_libraries()


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path_factory, monkeypatch):
    """A fresh, empty memfit store for every test."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.mktemp("memfit-cache")))


@pytest.fixture(autouse=True)
def no_heap_holes_from_earlier_tests(monkeypatch):
    """The holes a loop left in the heap count in every later plan of the process (memory.heap_holes): each test
    plans as a fresh process would, whatever ran before it."""
    from memfit.run import memory

    monkeypatch.setattr(memory, "_heap_holes", 0)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> folder of a tiny pipeline saved in the diffusers layout (built once per session)."""
    from memfit.testing import save_pipeline

    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, str] = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = str(save_pipeline(kind, root / kind, seed=0))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def memfit_server():
    """``with memfit_server(model, *flags) as (process, url):`` runs `memfit serve --model MODEL` (no --model
    where MODEL is None) on a free loopback port, answering at ``url``, until the block ends (killed if it
    still runs). ``process.output()`` is what it has printed so far."""
    import contextlib
    import socket
    import subprocess
    import sys
    import time

    import httpx

    @contextlib.contextmanager
    def serve(model: str | None, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # Its output goes to a file: a pipe nobody reads would stall a server that runs for a whole module.
        with tempfile.TemporaryFile("w+") as log:
            process = subprocess.Popen([sys.executable, "-m", "memfit", "serve", *(["--model", model] if model else []),
                                        "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT, text=True)
            # pread: the server writes through the same file offset, which a seek would move
            process.output = lambda: os.pread(log.fileno(), os.fstat(log.fileno()).st_size, 0).decode(errors="replace")
            url = f"http://127.0.0.1:{port}"
            try:
                deadline = time.time() + 120
                while time.time() < deadline and process.poll() is None:
                    try:
                        if httpx.get(url + "/sdapi/v1/options", timeout=2).status_code in (200, 401):  # 401: --api-auth
                            break
                    except httpx.TransportError:
                        time.sleep(0.2)
                else:
                    pytest.fail("server did not start: " + process.output())
                yield process, url
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait(30)

    return serve


@pytest.fixture
def browser():
    """A headless Debian chromium driven by selenium (quit at the end), or the test is skipped saying why."""
    import shutil

    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install 'memfit[browser]')")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no chromium/chromedriver here; on Debian: sudo apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    chromium = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chromium
    finally:
        chromium.quit()


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(os.environ["MEMFIT_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def nothing_in_use(monkeypatch):
    """Every device runtime says the process holds nothing on it before memfit places weights: the
    process's own memory (Python, torch) would swamp a tiny model's budget."""
    from memfit.devices import DeviceRuntime
    from memfit.run import runner

    monkeypatch.setattr(DeviceRuntime, "memory_in_use", lambda self: 0)
    monkeypatch.setattr(runner, "heap_holes", lambda: 0)  # nor the holes its heap keeps (memory.heap_holes)


@pytest.fixture
def streamed_plans(monkeypatch, nothing_in_use):
    """Budgets about a tiny model's size, and every plan memfit carries out, recorded.

    Calibrated activation offsets are real-size kernel workspace, and the process's own memory
    (Python, torch) would swamp a tiny model: only what memfit places is counted, activations are
    left out, and the prompt cache is off so the encode stage always loads (and streams) its encoders.
    """
    import memfit.run.fit as fit
    from memfit.plan import meta

    monkeypatch.setattr(meta, "ACTIVATION_OFFSETS", dict.fromkeys(meta.ACTIVATION_OFFSETS, 0))
    monkeypatch.setattr(meta, "ACTIVATION_FACTORS", dict.fromkeys(meta.ACTIVATION_FACTORS, 0))
    monkeypatch.setenv("MEMFIT_CACHE", "0")
    plans = []
    original = fit.optimize

    def recording(pipe, *args, plan=None, **kwargs):
        plans.append(plan)
        return original(pipe, *args, plan=plan, **kwargs)

    monkeypatch.setattr(fit, "optimize", recording)
    return plans


def _until_it_fits(run, start: int, named: str):
    """``run(value)`` from ``start``, then again with the value each refusal names (``named``: a pattern whose
    group is that value in bytes), a few times at most: (the value that fitted, what ``run`` returned)."""
    import re

    from memfit.errors import MemfitError

    value = start
    for _ in range(4):
        try:
            return value, run(value)
        except MemfitError as exc:
            found = re.search(named, str(exc))
            if not found:
                raise
            value = int(found.group(1))
    raise AssertionError(f"the refusals kept naming more ({named})")


def smallest_budget(**generate_kwargs) -> int:
    """The smallest budget memfit.generate(**generate_kwargs) plans every stage in, from its refusals."""
    import memfit

    return _until_it_fits(lambda budget: memfit.generate(progress=False, budget=budget, **generate_kwargs), 1,
                          r"smallest budget that works is (\d+) bytes")[0]


def with_staging_ring(run, device_budget: int, disk):
    """``run(budget)`` on a GPU with weights streamed from ``disk`` and no host RAM for them: the host budget
    only the pinned staging ring the disk tier streams through needs (the smallest the planner names)."""
    import memfit

    return _until_it_fits(lambda host: run(memfit.Budget(device=device_budget, host=host, disk=str(disk))), 0,
                          r"cannot hold the pinned staging ring.*host budget to at least (\d+) bytes")[1]


def benchmark_script(name: str, module_name: str):
    """benchmarks/NAME.py loaded as ``module_name`` (yielded, for a module-scoped fixture), with benchmarks/ on the
    path while it is used: the script imports its neighbours (common, quantized, ...)."""
    import importlib.util
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(module_name, script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(script.parent))
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(script.parent))


def seeded_image(pipe, settings: dict):
    """``pipe``'s first image for ``settings`` (prompt, steps, width, height, seed) with a seeded CPU generator, as
    int16 pixels: the reference a test builds itself (a component swapped in) rather than from a folder."""
    import numpy as np
    import torch

    out = pipe(prompt=settings["prompt"], num_inference_steps=settings["steps"], width=settings["width"],
               height=settings["height"], generator=torch.Generator().manual_seed(settings["seed"]))
    return np.asarray(out.images[0], dtype=np.int16)


def quantized_file_written(kind: str):
    """The one file memfit's cache holds for the quantized type ``kind``."""
    from memfit.cache import open_store

    entries = [entry for entry in open_store().ls("quantized") if entry.meta.get("type") == kind]
    assert len(entries) == 1
    return next(path for path in entries[0].path.rglob("*") if path.suffix in (".gguf", ".safetensors"))
