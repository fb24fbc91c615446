"""memfit serve as a real process on loopback: concurrent clients answered in order with the right
images, a client killed mid-request does not stall the queue, SIGTERM drains the running request."""

import base64
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # starts a server process and runs a few dozen generations

BASE = {"prompt": "a red circle", "negative_prompt": "blurry", "steps": 2, "cfg_scale": 3.5, "width": 32, "height": 32}


@pytest.fixture
def server(tiny_models, memfit_server):
    with memfit_server(tiny_models("sd")) as running:
        yield running


def post(url, body, timeout=300):
    return httpx.post(url + "/sdapi/v1/txt2img", json=body, timeout=timeout)


def wait_queued(url, task, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        progress = httpx.get(url + "/sdapi/v1/progress", params={"id_task": task}, timeout=10).json()
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


def wait_running(url, task, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        progress = httpx.get(url + "/sdapi/v1/progress", params={"id_task": task}, timeout=10).json()
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
    body = {**BASE, "steps": 150, "force_task_id": "doomed"}
    killed = subprocess.Popen([sys.executable, "-c",
                               f"import httpx, json; httpx.post({url!r} + '/sdapi/v1/txt2img', json=json.loads({json.dumps(json.dumps(body))}), timeout=600)"])
    wait_running(url, "doomed")
    killed.kill()
    killed.wait(30)
    started = time.time()
    after = post(url, {**BASE, "seed": 5}, timeout=120)
    assert after.status_code == 200
    report = httpx.get(url + "/memfit/v1/report/doomed").json()
    assert report["state"] == "interrupted" and report["finished_at"] < time.time()
    assert time.time() - started < 60


def test_sigterm_drains_the_running_request_and_exits_cleanly(server):
    process, url = server
    result = {}
    runner = threading.Thread(target=lambda: result.update(r=post(url, {**BASE, "steps": 150, "force_task_id": "last"})))
    runner.start()
    wait_running(url, "last")
    waiting = {}
    queued = threading.Thread(target=lambda: waiting.update(r=post(url, {**BASE, "seed": 9, "force_task_id": "next"})))
    queued.start()
    wait_queued(url, "next")  # signalled while the first still runs and the second waits behind it
    process.send_signal(signal.SIGTERM)
    runner.join(120)
    queued.join(120)
    assert result["r"].status_code == 200 and len(result["r"].json()["images"]) == 1
    assert waiting["r"].status_code == 503 and "stopped" in waiting["r"].json()["detail"]
    assert process.wait(60) == 0


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
