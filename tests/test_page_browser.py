"""The chat page in a real browser: Debian's headless Chromium, driven by Selenium through the system
chromedriver, against a real server on 127.0.0.1 (tests/scripted_server.py: the real engine with its
replies forced to known tokens, an API key, steps slowed where a test must act mid-answer).

Each test saves a screenshot under its tmp_path. With QWEN3_SCRATCH_WRITE_SCREENSHOTS=1 the chat and
the engine view are also written to docs/images/chat.png and docs/images/engine.png, for the docs.
"""

import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from live_server import wait_until
from make_tiny_checkpoint import make_tiny_checkpoint
from scripted_server import API_KEY, AUTH, BLOCK_SIZE, MODEL, SYSTEM, reset_around, scripted_server

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra: pip install -e .[test]")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Debian's chromium and chromium-driver are not installed (.ci/run installs them: "
    "apt-get install chromium chromium-driver)",
)
DOCS_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with scripted_server(make_tiny_checkpoint(tmp_path_factory.mktemp("browser") / "tiny")) as served:
        yield served


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,920",
                 "--force-device-scale-factor=1", "--lang=en-US"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # the system driver: no download
    yield driver
    driver.quit()


served = pytest.fixture(reset_around)


def wait(driver, condition, seconds: float = 30.0, message: str = ""):
    return WebDriverWait(driver, seconds, poll_frequency=0.02).until(lambda d: condition(d), message)


def js(driver, expression: str):
    return driver.execute_script(f"return {expression};")


def open_page(driver, url: str, path: str = "/") -> None:
    """Load the page and give it the key if it asks (sessionStorage keeps it for the tab after that)."""
    driver.get(url + path)
    wait(driver, lambda d: js(d, "document.getElementById('key-dialog').open") or d.find_element(By.ID, "model").text)
    if js(driver, "document.getElementById('key-dialog').open"):
        driver.find_element(By.ID, "key-input").send_keys(API_KEY + Keys.ENTER)
    wait(driver, lambda d: d.find_element(By.ID, "model").text == MODEL, message="the model's name is shown")


def settings(driver, thinking=True, calculator=False, max_tokens=200, system="") -> None:
    for name, on in (("thinking", thinking), ("calculator", calculator)):
        if driver.find_element(By.ID, name).is_selected() != on:
            driver.find_element(By.ID, name).click()
    for name, value in (("max-tokens", str(max_tokens)), ("system", system)):
        box = driver.find_element(By.ID, name)
        box.clear()
        if value:
            box.send_keys(value)


def ask(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        box.send_keys(line)
        if i < len(lines) - 1:
            box.send_keys(Keys.SHIFT, Keys.ENTER)  # a new line, not a send
    box.send_keys(Keys.ENTER)


def replies(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")


def idle(driver) -> bool:
    return not js(driver, "document.body.classList.contains('busy')")


def screenshot(driver, tmp_path: Path, name: str, docs: bool = False) -> None:
    driver.save_screenshot(str(tmp_path / f"{name}.png"))
    if docs and os.environ.get("QWEN3_SCRATCH_WRITE_SCREENSHOTS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(DOCS_IMAGES / f"{name}.png"))


# -- the chat -------------------------------------------------------------------------------------------


def test_the_page_asks_for_the_api_key_and_shows_the_servers_refusal_of_a_wrong_one(server, browser, tmp_path):
    browser.get(server.url + "/")
    js(browser, "sessionStorage.clear()")
    browser.refresh()
    wait(browser, lambda d: js(d, "document.getElementById('key-dialog').open"), message="a 401 opens the key dialog")
    browser.find_element(By.ID, "key-input").send_keys("wrong-key" + Keys.ENTER)
    refusal = wait(browser, lambda d: d.find_element(By.ID, "key-error").text)
    assert refusal == "The server refused the key: missing or wrong API key: send Authorization: Bearer <key>"
    screenshot(browser, tmp_path, "key")
    browser.find_element(By.ID, "key-input").send_keys(API_KEY + Keys.ENTER)
    wait(browser, lambda d: d.find_element(By.ID, "model").text == MODEL, message="with the right key the page goes on")
    assert js(browser, f"sessionStorage.getItem('qwen3-scratch-api-key') === '{API_KEY}'")


def test_a_streamed_answer_shows_its_reasoning_apart_and_folds_it_once_the_answer_starts(served, browser, tmp_path):
    open_page(browser, served.url)
    settings(browser)
    served.runner.delay = 0.04
    served.script("<think>\nThe user says hello over two lines, so I greet them back warmly.\n</think>\n\nHello there!")
    ask(browser, "Hello!\nHow are you?")
    # the reply as it first shows reasoning, read in one script call so that nothing moves in between
    first = wait(browser, lambda d: js(d, """(() => {
        const reply = document.querySelector('.message.assistant');
        const thoughts = reply && reply.querySelector('.thoughts').textContent;
        return thoughts && {open: reply.querySelector('details').open, answer: reply.querySelector('.answer').textContent};
    })()"""))
    assert first == {"open": True, "answer": ""}, "the reasoning streams first, shown open, before any answer"
    wait(browser, idle, message="the answer ends")
    reply = replies(browser)[-1]
    assert reply.find_element(By.CSS_SELECTOR, ".answer").text == "Hello there!"
    details = reply.find_element(By.TAG_NAME, "details")
    assert details.get_attribute("open") is None, "folded once the answer started"
    assert js(browser, "document.querySelector('.message.assistant .thoughts').textContent") == (
        "The user says hello over two lines, so I greet them back warmly.")
    assert "user\nHello!\nHow are you?<|im_end|>" in served.prompt_text(0), "Shift+Enter made a new line, Enter sent"
    assert "tokens" in reply.find_element(By.CSS_SELECTOR, ".footer").text
    screenshot(browser, tmp_path, "reasoning")
    # a second turn carries the first: the conversation is multi-turn
    served.script("Fine, thanks.")
    ask(browser, "And you?")
    wait(browser, lambda d: len(replies(d)) == 2 and idle(d), message="the second answer ends")
    assert "Hello there!<|im_end|>" in served.prompt_text(1) and served.prompt_text(1).endswith(
        "And you?<|im_end|>\n<|im_start|>assistant\n")


def test_thinking_off_reaches_the_template_and_the_answer_has_no_reasoning(served, browser, tmp_path):
    open_page(browser, served.url)
    settings(browser, thinking=False)
    served.script("Just the answer.")
    ask(browser, "Quick one?")
    wait(browser, lambda d: replies(d) and idle(d))
    assert served.prompt_text(0).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "enable_thinking: false"
    reply = replies(browser)[-1]
    assert reply.find_element(By.CSS_SELECTOR, ".answer").text == "Just the answer."
    assert not reply.find_element(By.TAG_NAME, "details").is_displayed()
    screenshot(browser, tmp_path, "no-thinking")


def test_a_calculator_call_is_shown_as_a_call_computed_by_the_page_and_its_result_sent_back(served, browser, tmp_path):
    open_page(browser, served.url)
    settings(browser, calculator=True)
    served.runner.delay = 0.01
    tool_call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>'
    served.script(f"<think>\nThe numbers are too long to work by hand, so I call the calculator.\n</think>\n\n{tool_call}")
    served.script("<think>\nThe calculator says 178377.\n</think>\n\n4821 * 37 = 178377")
    ask(browser, "What is 4821 * 37?")
    wait(browser, lambda d: len(replies(d)) == 2 and idle(d), message="the call, then the answer with its result")
    call = replies(browser)[0]
    assert call.find_element(By.CSS_SELECTOR, ".call-text").text == 'calculator(expression: "4821 * 37")'
    assert call.find_element(By.CSS_SELECTOR, ".call-result").text == "→ 178377"
    assert replies(browser)[1].find_element(By.CSS_SELECTOR, ".answer").text == "4821 * 37 = 178377"
    assert '"name": "calculator"' in served.prompt_text(0), "the page offered the calculator"
    assert "<tool_response>\n178377\n</tool_response>" in served.prompt_text(1), "the result went back as the tool's"
    call.find_element(By.TAG_NAME, "summary").click()  # unfold the call's reasoning, for the picture
    screenshot(browser, tmp_path, "chat", docs=True)


def test_the_calculator_computes_integer_arithmetic_exactly_and_evaluates_nothing_else(server, browser):
    open_page(browser, server.url)
    assert js(browser, "calculate('4821 * 37')") == "178377"
    assert js(browser, "calculate('-(2 - 10) * 3 + 99999999999 * 99999999999')") == str(24 + 99999999999**2)
    for hostile in ("alert(1)", "2 ** 3", "1; 2", "constructor", "2 / 3", "(1", "1e3", "window.x=1"):
        error = js(browser, f"(() => {{ try {{ calculate({hostile!r}); }} catch (e) {{ return e.message; }} }})()")
        assert error, f"calculate({hostile!r}) must refuse"
    result = js(browser, "runTool({name: 'calculator', arguments: '{\"expression\": \"alert(1)\"}'}).text")
    assert result == 'error: unexpected "alert"', "the tool's error goes back to the model as its result"
    assert js(browser, "typeof window.x") == "undefined"


def test_a_server_error_is_shown_as_the_server_wrote_it(served, browser, tmp_path):
    open_page(browser, served.url)
    settings(browser, max_tokens=100000)
    ask(browser, "Too long?")
    error = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".message.assistant .error-text").text)
    body = {"model": MODEL, "max_tokens": 100000, "messages": [{"role": "user", "content": "Too long?"}]}
    expected = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers=AUTH).json()["error"]["message"]
    assert error == expected
    screenshot(browser, tmp_path, "error")


def test_stop_aborts_a_long_answer_and_the_server_frees_its_blocks(served, browser, tmp_path):
    open_page(browser, served.url)
    settings(browser)
    # 0.2 s a step: the ~150-token answer cannot end in the engine for ~30 s, so the stop always reaches a request
    # still running (at 0.05 s a step a full CI run on a loaded machine once saw the engine finish the answer while
    # the page was still reading it; the stop then aborted nothing and no abort was counted)
    served.runner.delay = 0.2
    served.script("The cache keeps the keys and values of every token. " * 15)
    ask(browser, "Talk for a long time.")
    wait(browser, lambda d: len(d.find_element(By.CSS_SELECTOR, ".message.assistant .answer").text) > 20)
    assert served.metric("qwen3_kv_blocks_used") > 0 and served.metric("qwen3_num_requests_running") == 1
    browser.find_element(By.ID, "stop").click()
    wait(browser, idle, message="the page is ready again")
    assert "stopped" in replies(browser)[-1].find_element(By.CSS_SELECTOR, ".footer").text
    assert served.wait_idle() and served.metric("qwen3_kv_blocks_used") == 0, "every block is back in the pool"
    # the abort is counted by the request's handler once it sees the client gone, which can come a moment after
    # the engine has freed the blocks: wait for it rather than read it at once (a full CI run caught that race)
    assert served.metric("qwen3_num_requests_running") == 0
    assert wait_until(lambda: served.metric("qwen3_num_requests_aborted") >= 1), "the stopped request is counted"
    text = replies(browser)[-1].find_element(By.CSS_SELECTOR, ".answer").text
    assert 20 < len(text) < len("The cache keeps the keys and values of every token. " * 15)
    screenshot(browser, tmp_path, "stopped")


def test_markup_in_model_output_is_shown_as_text_and_runs_nothing(served, browser, tmp_path):
    open_page(browser, served.url)
    settings(browser)
    markup = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script><b>bold</b>'
    served.script(f"<think>\n<img src=y onerror=\"window.__pwned=3\">\n</think>\n\n{markup}")
    ask(browser, "Say something with markup.")
    wait(browser, lambda d: replies(d) and idle(d))
    reply = replies(browser)[-1]
    assert js(browser, "document.querySelector('.message.assistant .answer').textContent") == markup
    assert reply.find_element(By.CSS_SELECTOR, ".thoughts").get_attribute("textContent") == (
        '<img src=y onerror="window.__pwned=3">')
    assert reply.find_elements(By.CSS_SELECTOR, "img, script, b") == [], "no element made from the model's text"
    assert js(browser, "typeof window.__pwned") == "undefined", "no handler or script of the model's ran"
    screenshot(browser, tmp_path, "markup")


# -- the engine view ------------------------------------------------------------------------------------


def stream_in_background(url: str, body: dict) -> threading.Thread:
    def run():
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as response:
            for _ in response.iter_lines():
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_engine_view_shows_running_requests_and_the_blocks_their_system_prompt_shares(served, browser, tmp_path):
    open_page(browser, served.url)
    settings(browser, system=SYSTEM)
    browser.find_element(By.ID, "toggle-engine").click()
    served.runner.delay = 0.06
    served.script("The first answer goes on and on about caches. " * 12)
    served.script("The second answer goes on and on about blocks. " * 12)
    ask(browser, "What is a cache?")
    wait(browser, lambda d: d.find_element(By.ID, "stat-running").text == "1", message="the panel shows it running")
    other = stream_in_background(served.url, {"model": MODEL, "max_tokens": 200, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "And a block table?"}]})  # fmt: skip
    wait(browser, lambda d: d.find_element(By.ID, "stat-running").text == "2", message="both requests running")
    a, b = served.runner.prompts
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) // BLOCK_SIZE
    assert shared >= 3, "the system prompt spans several blocks"
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid .cell.shared")) == shared,
         message=f"{shared} shared blocks drawn")  # fmt: skip
    assert browser.find_element(By.ID, "count-shared").text == str(shared)
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tr.running")
    assert len(rows) == 2, "both requests listed as running"
    assert rows[1].find_elements(By.TAG_NAME, "td")[2].text == f"{len(b)} ({shared * BLOCK_SIZE} cached)"
    screenshot(browser, tmp_path, "engine-panel")
    browser.switch_to.new_window("tab")  # the engine alone, while the chat tab's answer streams on
    open_page(browser, served.url, "/engine")
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#requests tr.running")) == 2)
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid .cell.shared")) == shared)
    screenshot(browser, tmp_path, "engine", docs=True)
    browser.close()
    browser.switch_to.window(browser.window_handles[0])
    browser.find_element(By.ID, "stop").click()
    served.runner.delay = 0
    other.join(30)
