"""Stop strings: bounded in number and length on /runs and /v1; a stream checks only where one may end."""

from __future__ import annotations

import random
import time

import pytest

from coordinator.api.stops import Holdback, sendable
from coordinator.runs.requests import MAX_STOP_CHARS, MAX_STOPS


def from_scratch(text: str, stops: list[str]) -> int:
    """What may be sent of the whole text, found by looking at all of it: the definition itself."""
    end = len(text)
    for stop in stops:
        if (at := text.find(stop)) >= 0:
            end = min(end, at)
            continue
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return end


@pytest.mark.parametrize("seed", range(40))
def test_a_stream_let_out_piece_by_piece_sends_what_the_whole_text_so_far_allows(seed):
    rng = random.Random(seed)
    # Few letters, stops that overlap themselves and each other: every way of nearly matching comes up.
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    held, text, sent = Holdback(stops), "", ""
    for _ in range(60):
        piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
        text += piece
        sent += held.push(piece)
        assert sent == text[: from_scratch(text, stops)], (stops, text)
        assert held.sent == len(sent)
        if len(sent) < len(text) and any(stop in text for stop in stops):
            break  # the run ends its text at the stop: nothing more comes


def test_a_stop_split_across_pieces_is_held_back_and_what_turns_out_not_to_be_one_is_let_out():
    held = Holdback(["\n\nUser:"])
    assert held.push("Paris.\n") == "Paris."
    assert held.push("\nUs") == ""
    assert held.push("ed to be") == "\n\nUsed to be"
    assert held.push(" grand.\n\nUser: hi") == " grand."
    assert held.push(" more") == "" and held.sent == len("Paris.\n\nUsed to be grand.")


def test_checking_a_long_stream_against_the_most_and_longest_stops_costs_little_per_token():
    # One stop begins with what the text is made of, so an end of it is always held back; the text
    # never begins the others, so no end of it is worth a second look.
    held_back = "the " * (MAX_STOP_CHARS // 4 - 1) + "end"
    stops = [held_back] + ["q" * (MAX_STOP_CHARS - 1) + str(i) for i in range(MAX_STOPS - 1)]
    held, tokens = Holdback(stops), 4096
    started = time.thread_time()  # this thread's CPU: what the event loop would spend, whatever else runs
    for _ in range(tokens):
        held.push("the ")
    per_token = (time.thread_time() - started) / tokens
    # Looking at the whole text, and at every end of it for each stop, took 0.24 ms a token here; 7 µs now.
    assert per_token < 5e-5, f"{per_token * 1e6:.0f} µs per token"
    assert held.sent == 4 * tokens - (MAX_STOP_CHARS - 4)  # what may still begin a stop, and no more


@pytest.mark.parametrize(
    ("stop", "says"),
    [
        ([f"s{i}" for i in range(MAX_STOPS + 1)], f"Expected `array` of length <= {MAX_STOPS} - at `$.stop`"),
        (["x" * (MAX_STOP_CHARS + 1)], f"Expected `str` of length <= {MAX_STOP_CHARS} - at `$.stop[0]`"),
    ],
    ids=["too-many", "too-long"],
)
async def test_too_many_or_too_long_stop_strings_are_a_400_naming_the_limit_on_runs_and_v1(api, stop, says):
    status, body, _ = await api.post("/runs", json={"seq": 2, "stop": stop})
    assert status == 400 and says in body["error"], body
    chat = {"model": "fake:layers=4", "messages": [{"role": "user", "content": "hi"}], "stop": stop}
    status, body, _ = await api.post("/v1/chat/completions", json=chat)
    assert status == 400 and says in body["error"]["message"], body
    if len(stop) == 1:  # one string, not in a list, as OpenAI's API also takes it
        status, body, _ = await api.post("/v1/chat/completions", json={**chat, "stop": stop[0]})
        assert status == 400 and f"length <= {MAX_STOP_CHARS}" in body["error"]["message"], body
    assert (await api.get("/runs"))[1]["runs"] == []


def test_the_one_shot_answer_is_the_holdbacks_for_the_whole_text():
    assert sendable("The capital of France is", ["is Paris"]) == 22
    assert sendable("abc", ["abcd"]) == 0
    assert sendable("no stops", []) == 8
