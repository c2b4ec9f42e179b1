"""The Limiter over a real Redis: one limit across instances, and Redis failing under it."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import pytest
from redis.asyncio import Redis

from engine.errors import Overloaded, RateLimited
from engine.limits import Admission, Limiter, build_limiter
from engine.limits.redis_backend import RedisBackend
from engine.settings import RateLimitSettings
from tests.redis_process import RedisProcess
from tests.redis_proxy import HoldingProxy

T = TypeVar("T")


def settings(url: str, **extra: Any) -> RateLimitSettings:
    return RateLimitSettings.model_validate(
        {"backend": "redis", "redis_url": url, "namespace": f"t{uuid.uuid4().hex[:12]}", **extra}
    )


async def test_two_limiters_sharing_redis_hold_one_global_limit(redis_url: str) -> None:
    rate, burst, duration_s = 20.0, 5.0, 1.0
    # A generous timeout: this test is about one shared limit, and a loaded CI host can hold one
    # Redis round trip past the 50 ms default (the fallback has its own tests below).
    config = settings(
        redis_url, tenants={"acme": {"rate_per_s": rate, "burst": burst}}, redis_timeout_s=2.0
    )
    limiters = [build_limiter(config), build_limiter(config)]
    accepted = [0, 0]

    async def hammer(index: int, until: float) -> None:
        while time.monotonic() < until:
            try:
                with await limiters[index].admit("acme", "m"):
                    accepted[index] += 1
            except RateLimited:
                pass
            await asyncio.sleep(0.004)  # pacing (~250 attempts/s each), not synchronisation

    started = time.monotonic()
    until = started + duration_s
    await asyncio.gather(hammer(0, until), hammer(1, until))
    elapsed_s = time.monotonic() - started
    for limiter in limiters:
        assert limiter.counters.backend_failures == 0
        await limiter.aclose()
    total = sum(accepted)
    assert total <= rate * elapsed_s + burst + 1
    assert total >= rate * duration_s * 0.7
    assert min(accepted) > 0


async def run_all(limiter: Limiter, count: int) -> list[object]:
    async def one() -> object:
        try:
            return await limiter.admit("acme", "m")
        except (RateLimited, Overloaded) as exc:
            return exc

    return await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)


def kinds(results: list[object]) -> Counter[str]:
    """How many results of each type (concurrent admissions reach Redis in any order)."""
    return Counter(type(result).__name__ for result in results)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def make(process: RedisProcess, clock: Clock, **extra: Any) -> Limiter:
    config = settings(process.url, tenants={"acme": {"rate_per_s": 0.01, "burst": 3}}, **extra)
    backend = RedisBackend(
        process.url,
        namespace=config.namespace,
        timeout_s=0.5,
        retry_interval_s=config.redis_retry_interval_s,
        clock=clock,
    )
    return Limiter(config, backend, clock=clock)


async def test_redis_killed_fail_open_uses_the_local_limiter(redis_process: RedisProcess) -> None:
    clock = Clock()
    limiter = make(redis_process, clock)
    first = await run_all(limiter, 2)
    assert all(isinstance(result, Admission) for result in first)
    redis_process.stop()
    during = await run_all(limiter, 5)
    # The local limiter starts with a full bucket of its own: 3 pass, the rest are refused.
    assert kinds(during) == {"Admission": 3, "RateLimited": 2}
    assert limiter.counters.fallback_admissions == 5
    assert (await limiter.usage("acme"))["source"] == "memory (fallback: redis unavailable)"
    redis_process.start()  # an empty Redis on the same port: the old bucket is gone
    clock.now += 1.0  # past redis_retry_interval_s
    after = await run_all(limiter, 4)
    assert kinds(after) == {"Admission": 3, "RateLimited": 1}
    assert (await limiter.usage("acme"))["source"] == "redis"
    await limiter.aclose()


async def test_redis_killed_fail_closed_answers_overloaded(redis_process: RedisProcess) -> None:
    clock = Clock()
    limiter = make(redis_process, clock, fail_open=False, redis_retry_interval_s=2.0)
    assert isinstance((await run_all(limiter, 1))[0], Admission)
    pending = asyncio.ensure_future(run_all(limiter, 5))
    await asyncio.sleep(0)  # let the five admissions start before Redis dies under them
    redis_process.stop()
    results = list(await pending) + list(await run_all(limiter, 5))
    assert all(isinstance(result, Admission | Overloaded) for result in results)
    overloaded = [result for result in results if isinstance(result, Overloaded)]
    assert len(overloaded) >= 5
    assert {error.retry_after_s for error in overloaded} == {2.0}
    with pytest.raises(Overloaded):
        await limiter.usage("acme")
    redis_process.start()
    clock.now += 2.0
    assert isinstance((await run_all(limiter, 1))[0], Admission)
    await limiter.aclose()


async def test_cancelled_while_waiting_for_redis_releases_the_slot(redis_url: str, proxy) -> None:
    url = f"redis://127.0.0.1:{proxy.port}/0"
    tenants = {"acme": {"rate_per_s": 0.001, "burst": 5, "max_concurrent": 1}}
    limiter = build_limiter(settings(url, tenants=tenants, redis_timeout_s=5.0))
    with await limiter.admit("acme", "m") as first:
        assert first.headers["X-RateLimit-Remaining"] == "4"
    proxy.hold()
    task = asyncio.create_task(limiter.admit("acme", "m"))
    await proxy.reply_held.wait()  # Redis ran the script; its answer is held back
    assert limiter.in_flight("acme") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert limiter.in_flight("acme") == 0
    proxy.release()
    # The cancelled call's late reply must not reach the next caller: it sees its own answer.
    with await limiter.admit("acme", "m") as third:
        assert third.headers["X-RateLimit-Remaining"] == "2"
    assert limiter.counters.backend_failures == 0
    await limiter.aclose()


async def test_slow_redis_fail_open_answers_within_the_timeout(redis_url: str, proxy) -> None:
    url = f"redis://127.0.0.1:{proxy.port}/0"
    limiter = build_limiter(
        settings(url, tenants={"acme": {"rate_per_s": 1}}, redis_timeout_s=0.05)
    )
    (await limiter.admit("acme", "m")).release()
    proxy.hold()
    loop = asyncio.get_running_loop()
    started = loop.time()
    admission = await limiter.admit("acme", "m")  # the local bucket is still full
    assert loop.time() - started < 1.0
    assert admission.headers["X-RateLimit-Remaining"] == "0"
    assert limiter.counters.fallback_admissions == 1
    await limiter.aclose()


def stall_settings(url: str, *, fail_open: bool) -> RateLimitSettings:
    # A timeout generous enough for a loaded machine: only the stalled call may run into it.
    tenants = {"acme": {"rate_per_s": 0.001, "burst": 5, "quota_per_day": 10}}
    return settings(url, tenants=tenants, fail_open=fail_open, redis_timeout_s=0.5)


async def stored(client: Redis, config: RateLimitSettings) -> tuple[int, int]:
    """acme's bucket tokens (rounded: they refill 0.001 per second) and day count in Redis."""
    prefix = f"{config.namespace}:rl:{{acme}}:*:"
    tokens = await client.hget(prefix + "bucket", "tokens")
    used = await client.hget(prefix + "day", "used")
    return round(float(tokens or 0)), int(used or 0)


async def evalsha_calls(client: Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def eventually(read: Callable[[], Awaitable[T]], want: T, bound_s: float = 5.0) -> T:
    """`read()`'s value once it is `want`, or its last one after `bound_s` (a bound, not a
    synchronisation: the caller asserts on what comes back)."""
    deadline = time.monotonic() + bound_s
    while True:
        value = await read()
        if value == want or time.monotonic() >= deadline:
            return value
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(("fail_open", "charged"), [(False, 1), (True, 2)])
async def test_a_request_refused_in_a_redis_stall_is_not_charged_when_redis_resumes(
    redis_process: RedisProcess, fail_open: bool, charged: int
) -> None:
    """The admission sent into a stall waits in Redis's socket buffer and its script runs when
    Redis resumes. fail_open false: the request was refused (503), so that late run must charge
    nothing. fail_open true: the local limiter admitted the request and it ran, so Redis counting
    it when it catches up is right (a stall must not make requests free)."""
    config = stall_settings(redis_process.url, fail_open=fail_open)
    async with (
        aclosing(build_limiter(config)) as limiter,
        Redis.from_url(redis_process.url) as client,
    ):
        (await limiter.admit("acme", "m")).release()
        assert await stored(client, config) == (4, 1)
        sent = await evalsha_calls(client)
        redis_process.pause()
        try:
            if fail_open:
                (await limiter.admit("acme", "m")).release()
                assert limiter.counters.fallback_admissions == 1
            else:
                with pytest.raises(Overloaded):
                    await limiter.admit("acme", "m")
                assert limiter.counters.rejections[("acme", "unavailable")] == 1
        finally:
            redis_process.resume()
        # The stalled script has run once Redis counts one more EVALSHA.
        assert await eventually(lambda: evalsha_calls(client), sent + 1) == sent + 1
        assert await stored(client, config) == (5 - charged, charged)


def charge_tasks() -> int:
    """Admission calls' tasks still in memory, collectable garbage included. By exact type, not
    isinstance: that reads `__class__`, which some objects (torch's deprecated aliases) warn on."""
    return sum(
        type(o) is asyncio.Task and o.get_coro().__qualname__ == "RedisBackend._charge_by_deadline"
        for o in gc.get_objects()
    )


async def test_an_admission_that_ran_past_its_deadline_leaves_no_cycle(
    redis_process: RedisProcess,
) -> None:
    """The call that runs a refused admission ended with an error (the script ran late) that its
    task keeps, whose traceback held the frame waiting for it, which held the task: each
    admission refused in a Redis stall stayed in memory until the cyclic collector ran."""
    config = stall_settings(redis_process.url, fail_open=False)
    async with (
        aclosing(build_limiter(config)) as limiter,
        Redis.from_url(redis_process.url) as client,
    ):
        (await limiter.admit("acme", "m")).release()
        sent = await evalsha_calls(client)
        gc.collect()
        gc.disable()
        try:
            redis_process.pause()
            try:
                with pytest.raises(Overloaded):
                    await limiter.admit("acme", "m")
            finally:
                redis_process.resume()
            assert await eventually(lambda: evalsha_calls(client), sent + 1) == sent + 1

            async def left() -> int:
                return charge_tasks()

            assert await eventually(left, 0) == 0
        finally:
            gc.enable()


async def test_an_admission_refused_as_redis_went_away_leaves_no_cycle(
    redis_process: RedisProcess,
) -> None:
    """As above, for the call's connection error: the admission that waited for the call kept
    the task, whose error's traceback held that admission's frame."""
    tenants = {"acme": {"rate_per_s": 0.001, "burst": 5}}
    config = settings(
        redis_process.url, tenants=tenants, fail_open=False, redis_retry_interval_s=0.05
    )
    async with aclosing(build_limiter(config)) as limiter:
        (await limiter.admit("acme", "m")).release()
        gc.collect()
        gc.disable()
        try:
            redis_process.stop()
            with pytest.raises(Overloaded, match="Connection closed by server"):
                await limiter.admit("acme", "m")  # its connection breaks while it reads
            assert charge_tasks() == 0
            await asyncio.sleep(0.1)  # past the retry interval: the next call connects
            with pytest.raises(Overloaded, match="Connect"):
                await limiter.admit("acme", "m")  # its connection is refused
            assert charge_tasks() == 0
        finally:
            gc.enable()


async def test_a_refused_request_whose_late_reply_says_charged_is_refunded(
    redis_url: str, proxy: HoldingProxy
) -> None:
    """The script ran in time but its reply came after the timeout (a network hiccup, a busy
    event loop): the request was refused (503), so the charge the reply reports is given back."""
    config = stall_settings(proxy.url, fail_open=False)
    async with aclosing(build_limiter(config)) as limiter, Redis.from_url(redis_url) as client:
        (await limiter.admit("acme", "m")).release()
        proxy.hold()
        refused = asyncio.create_task(limiter.admit("acme", "m"))
        await proxy.reply_held.wait()  # Redis ran the script, so it charged; its reply is held
        assert await stored(client, config) == (3, 2)
        with pytest.raises(Overloaded):
            await refused
        assert limiter.counters.late_refunds == 0
        proxy.release()
        assert await eventually(lambda: stored(client, config), (4, 1)) == (4, 1)

        # Counted once the refund's own reply is in (sluice_admission_late_refunds_total).
        async def late_refunds() -> int:
            return limiter.counters.late_refunds

        assert await eventually(late_refunds, 1) == 1
