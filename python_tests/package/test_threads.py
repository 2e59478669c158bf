"""Threads and the CPU kernels: whatever thread runs which rows, and however many Python threads call at once, a
call gives the same results (the kernels release the GIL, so calls from several threads do overlap). The verify ops
run their loops on the claiming pool (csrc/cpu/claiming_pool.h): any number of helpers, a forked child's own
helpers, and drafts without distributions must all give a lone thread's results."""

import multiprocessing
import threading

import pytest
import torch

import diversed_ext as dx
from helpers import random_problem

# Rows long enough that every call is split over threads (a task of at least 32768 elements per thread).
BATCH, NUM_POSITIONS, VOCAB = 6, 3, 40_000
JOIN_TIMEOUT_S = 120


def _problem():
    tokens, draft, target = random_problem(BATCH, NUM_POSITIONS, VOCAB, seed=3, sharpness=1.0)
    uniforms = torch.rand(BATCH, NUM_POSITIONS + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    return tokens, draft, target, draft.log(), target.log(), uniforms


def _verify_both(tokens, draft, target, draft_logits, target_logits, uniforms):
    probs = dx.verify(tokens, draft, target, 0.6, uniforms=uniforms, check_inputs=False)
    logits = dx.verify_logits(tokens, draft_logits, target_logits, 0.6, uniforms=uniforms, check_inputs=False)
    tokens_only = dx.verify(tokens, None, target, 0.6, uniforms=uniforms, check_inputs=False)
    logits_tokens_only = dx.verify_logits(tokens, None, target_logits, 0.6, uniforms=uniforms, check_inputs=False)
    return probs, logits, tokens_only, logits_tokens_only


def _with_threads(count, function, *args):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(count)
        return function(*args)
    finally:
        torch.set_num_threads(threads)


def _assert_same(first, second):
    for a, b in zip(first, second):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_one_thread_and_all_threads_agree():
    problem = _problem()
    alone = _with_threads(1, _verify_both, *problem)
    _assert_same(alone, _verify_both(*problem))


def test_more_threads_than_cores_agree():
    """Helpers beyond the cores: most of them start late, and the calls must neither wait for them nor lose rows."""
    problem = _problem()
    alone = _with_threads(1, _verify_both, *problem)
    for count in (3, 8):
        for _ in range(10):
            _assert_same(alone, _with_threads(count, _verify_both, *problem))


def _child_verify(connection, problem):
    """In the forked child: only the verify ops run (any other torch op could enter the OpenMP pool, which a forked
    child of a process that used it cannot start)."""
    connection.send([[field.tolist() for field in result] for result in _verify_both(*problem)])
    connection.close()


# CPython 3.12+ warns when a multi-threaded process forks: that fork is the case under test.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_a_forked_child_finishes_and_agrees():
    """A child forked after the parent's helpers ran has none of them: its calls must not wait for them."""
    problem = _problem()
    expected = _verify_both(*problem)  # the parent's pool is running
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child_verify, args=(sender, problem))
    child.start()
    try:
        assert receiver.poll(JOIN_TIMEOUT_S), "the forked child's verify calls did not finish"
        received = receiver.recv()
    finally:
        child.join(timeout=JOIN_TIMEOUT_S)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert received == [[field.tolist() for field in result] for result in expected]


def test_concurrent_callers_get_what_a_lone_caller_gets():
    """Python threads calling at once, each call splitting its rows over torch's threads."""
    problem = _problem()
    expected = _verify_both(*problem)
    results, errors = [], []

    def call():
        try:
            for _ in range(5):
                results.append(_verify_both(*problem))
        except Exception as error:  # noqa: BLE001  reported below, so the test fails rather than the thread
            errors.append(error)

    workers = [threading.Thread(target=call) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=JOIN_TIMEOUT_S)
    assert not errors and not any(worker.is_alive() for worker in workers)
    assert len(results) == 20
    for result in results:
        _assert_same(expected, result)
