"""memfit serve as a real process on loopback: concurrent clients answered in order with the right
images, a client killed mid-request or while waiting does not stall the queue, a huge prompt is refused
at once, SIGTERM answers the waiting requests and stops the running one after its grace period."""

import base64
import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # starts a server process and runs a few dozen generations

BASE = {"prompt": "a red circle", "negative_prompt": "blurry", "steps": 2, "cfg_scale": 3.5, "width": 32, "height": 32}
# The long requests below must run, however slow this machine is (the estimate is tested in test_serve.py).
NO_ESTIMATE = ("--max-seconds", "0")


@pytest.fixture(scope="module")
def server(tiny_models, memfit_server):
    """One server for the module's tests that leave it running."""
    with memfit_server(tiny_models("sd"), *NO_ESTIMATE) as running:
        yield running


# Runs for as long as the server would let it (8 images, 150 steps each): stopped by the test, never finished.
LONG = {**BASE, "steps": 150, "width": 64, "height": 64, "batch_size": 8}


def client_process(url, body, headers=None):
    """A client in a process of its own, to be killed as a client that goes away would be."""
    code = (f"import httpx, json; httpx.post({url!r} + '/sdapi/v1/txt2img', json=json.loads({json.dumps(json.dumps(body))}), "
            f"headers={headers!r}, timeout=600)")
    return subprocess.Popen([sys.executable, "-c", code])


def post(url, body, timeout=300, headers=None):
    return httpx.post(url + "/sdapi/v1/txt2img", json=body, timeout=timeout, headers=headers)


def wait_queued(url, task, timeout=120, headers=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        progress = httpx.get(url + "/sdapi/v1/progress", params={"id_task": task}, timeout=10, headers=headers).json()
        if progress["memfit"]["queue_position"] == 1:
            return progress
        time.sleep(0.05)
    pytest.fail(f"task {task} never waited in the queue")


def wait_known(url, task, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        progress = httpx.get(url + "/sdapi/v1/progress", params={"id_task": task}, timeout=10).json()
        if progress["memfit"]["job"] == task:
            return progress
        time.sleep(0.02)
    pytest.fail(f"the server never received task {task}")


def wait_running(url, task, timeout=120, headers=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        progress = httpx.get(url + "/sdapi/v1/progress", params={"id_task": task}, timeout=10, headers=headers).json()
        if progress["memfit"]["queue_position"] == 0 and progress["state"]["sampling_step"] >= 1:
            return progress
        time.sleep(0.05)
    pytest.fail(f"task {task} never ran")


def test_concurrent_clients_are_answered_once_in_order_with_their_images(server, tiny_models):
    from memfit.run.generate import generate
    from memfit.run.media import png_bytes

    _, url = server
    clients, responses = 4, {}

    def client(i):
        responses[i] = post(url, {**BASE, "seed": 100 + i, "force_task_id": f"c{i}"})

    threads = []
    for i in range(clients):
        threads.append(threading.Thread(target=client, args=(i,)))
        threads[-1].start()
        wait_known(url, f"c{i}")  # arrival order: the next client posts once the server has this one
    for thread in threads:
        thread.join(300)
    assert sorted(responses) == list(range(clients))
    started = []
    for i in range(clients):  # in arrival order (``responses`` is in the order the answers came back)
        response = responses[i]
        assert response.status_code == 200, response.text
        info = json.loads(response.json()["info"])
        assert info["seed"] == 100 + i and info["memfit"]["job"] == f"c{i}"
        expected = generate(BASE["prompt"], model=tiny_models("sd"), negative_prompt="blurry", steps=2, guidance=3.5,
                            width=32, height=32, seed=100 + i, progress=False)
        assert base64.b64decode(response.json()["images"][0]) == png_bytes(expected.images[0], expected.metadata)
        started.append(httpx.get(url + info["memfit"]["report"]).json()["started_at"])
    assert started == sorted(started), "not first in, first out"


def test_a_client_killed_mid_request_does_not_stall_the_queue(server):
    _, url = server
    killed = client_process(url, {**BASE, "steps": 150, "force_task_id": "doomed"})
    wait_running(url, "doomed")
    killed.kill()
    killed.wait(30)
    started = time.time()
    after = post(url, {**BASE, "seed": 5}, timeout=120)
    assert after.status_code == 200
    report = httpx.get(url + "/memfit/v1/report/doomed").json()
    assert report["state"] == "interrupted" and report["finished_at"] < time.time()
    assert time.time() - started < 60


def test_a_huge_prompt_is_refused_at_once_naming_the_limit(server):
    _, url = server
    before = httpx.get(url + "/sdapi/v1/memory").json()["ram"]["used"]
    started = time.time()
    huge = post(url, {**BASE, "prompt": "a red circle " * 3_800_000}, timeout=60)  # 49.4 MB, 47.1 MiB of JSON
    assert huge.status_code == 422, huge.text
    assert huge.json()["detail"].startswith("prompt has 49400000 characters, more than the 20000 a request may send")
    larger = post(url, {**BASE, "prompt": "a" * 60_000_000}, timeout=60)
    assert larger.status_code == 413 and "more than the 48.00 MiB a request may send" in larger.json()["detail"]
    assert time.time() - started < 30
    grew = httpx.get(url + "/sdapi/v1/memory").json()["ram"]["used"] - before
    assert grew < 400 * 2**20, f"the server grew by {grew / 2**20:.0f} MiB"


def test_behind_api_auth_a_gone_client_is_dropped_and_sigterm_stops_the_running_request_after_its_grace(
        tiny_models, memfit_server):
    # A lower-case scheme name, as some clients send it: HTTP's scheme names are case-insensitive.
    auth = {"authorization": "basic " + base64.b64encode(b"user:secret").decode()}
    flags = ("--api-auth", "user:secret", "--shutdown-grace", "1", *NO_ESTIMATE)
    with memfit_server(tiny_models("sd"), *flags) as (process, url):
        result = {}
        runner = threading.Thread(target=lambda: result.update(r=post(url, {**LONG, "force_task_id": "last"},
                                                                      headers=auth)))
        runner.start()
        wait_running(url, "last", headers=auth)
        # A waiting request whose client goes away leaves the queue at once (behind auth too).
        gone = client_process(url, {**BASE, "force_task_id": "gone"}, headers=auth)
        wait_queued(url, "gone", headers=auth)
        gone.kill()
        gone.wait(30)
        time.sleep(1)
        assert httpx.get(url + "/memfit/v1/report/gone", headers=auth).json()["state"] == "cancelled"
        waiting = {}
        queued = threading.Thread(target=lambda: waiting.update(r=post(url, {**BASE, "seed": 9, "force_task_id": "next"},
                                                                       headers=auth)))
        queued.start()
        wait_queued(url, "next", headers=auth)  # signalled while the first still runs and the second waits behind it
        signalled = time.time()
        process.send_signal(signal.SIGTERM)
        runner.join(120)
        queued.join(120)
        assert waiting["r"].status_code == 503 and "stopped" in waiting["r"].json()["detail"]
        assert result["r"].status_code == 200 and json.loads(result["r"].json()["info"])["memfit"]["interrupted"]
        assert process.wait(60) == 0 and time.time() - signalled < 30
        output = process.output()
    assert "memfit serve: SIGTERM: stopping; 1 waiting request(s) answered 503, the running one last has 1 s to " \
           "finish" in output, output
    assert "memfit serve: txt2img next: 32x32, 2 steps, 1 image(s): 503 cancelled in " in output, output
    assert "memfit serve: txt2img last: 64x64, 150 steps, 8 image(s): 200 interrupted in " in output, output
    # The running request was stopped before its 8 images: how many its 1 s of grace finished depends on the machine.
    last_line = output.rstrip().splitlines()[-1]
    done = re.fullmatch(r"memfit serve: stopped after answering 1 generation requests \((\d) images\)", last_line)
    assert done and int(done.group(1)) < 8, output


def test_the_web_page_in_a_real_browser_shows_the_apis_image(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _, url = server
    browser.get(url + "/")
    # Progress answers arrive a second late, so a poll is still in flight when the run ends: its late
    # answer must not overwrite the final status (nor the full bar).
    browser.execute_script("""
        const original = window.fetch;
        window.fetch = (resource, ...rest) => String(resource).includes("/sdapi/v1/progress")
            ? original(resource, ...rest).then(answer => new Promise(done => setTimeout(() => done(answer), 1000)))
            : original(resource, ...rest);""")
    fields = {"prompt": "a red circle", "negative_prompt": "blurry", "steps": "2", "cfg_scale": "3.5", "width": "32",
              "height": "32", "seed": "42"}
    for field, value in fields.items():
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 120).until(lambda b: b.find_elements(By.ID, "image"))
    src = browser.find_element(By.ID, "image").get_attribute("src")
    assert src.startswith("data:image/png;base64,")
    shown = base64.b64decode(src.split(",", 1)[1])
    time.sleep(1.5)  # every poll sent before the end has answered by now
    report = browser.find_element(By.ID, "report").text
    parameters = browser.find_element(By.ID, "parameters").text
    assert "denoise" in report and "peak" in report and "Seed: 42" in parameters
    assert "done in" in browser.find_element(By.ID, "status").text
    width = browser.execute_script("return document.getElementById('bar').firstElementChild.style.width")
    assert width == "100%"
    api = post(url, {**BASE, "seed": 42})
    assert shown == base64.b64decode(api.json()["images"][0])
