"""`helm upgrade` with new chain settings, step by step as the chart runs it, against the real
broker with messages waiting in the old chain's levels and meditation queue.

The chart is rendered for the old and the new values; tests/k8s/pods.py runs its
containers as local processes with exactly their arguments and environment:
1. install: 2 check-in and 2 distributor pods (each declares at start), then the
   post-install hook Job (`declare`);
2. messages are published all along, with delays of up to 4 s: those due within 2 s
   (holdWithinMs) go from check-in straight to the distributor pods, which hold them as they
   roll (the shorter path); the others wait in the old chain, and those longer than its
   maximum (1.4 s, 3 s) lap its meditation queue during the upgrade;
3. upgrade: the pre-upgrade hook Job declares the new chain beside the old one, then each
   Deployment rolls as its strategy says (maxSurge 1, maxUnavailable 0: a new pod must be
   ready, /readyz, before an old one gets SIGTERM), both Deployments at once;
4. every message arrives: none lost, none early, none later than the bound; the old chain's
   queues have drained by themselves; and the chart's `helm test` pod passes against the
   new pods.
About 15 s per scenario.
"""

import json
import random
import threading
import time
from statistics import quantiles
from urllib.parse import urlsplit, urlunsplit

import pika
import pytest

from topology import ChainSettings, build

from ..support import Receiver, broker_url, connect, now_ms, remove, unique_prefix, wait_until
from .manifests import by_kind, render
from .pods import Kubelet

# Never early is exact. Lateness: the usual figure is tens of ms (BENCHMARKS.md); the
# bound leaves room for a loaded 2-core machine while still catching a message that waited
# for a retry, a lap or a lost consumer (each costs seconds).
LATE_BOUND_MS = 1500
MESSAGES, SPREAD_S, MAX_DELAY_MS = 300, 3.0, 4000
UPGRADE_AT_S = 1.5

SCENARIOS = {
    "maxLevel 3 to 5": ({"maxLevel": 3, "resolutionMs": 200}, {"maxLevel": 5, "resolutionMs": 200}),
    "maxLevel 4 to 3, 200 to 150 ms, quorum to classic, zero bits queue to exchange": (
        {"maxLevel": 4, "resolutionMs": 200},
        {"maxLevel": 3, "resolutionMs": 150, "queueType": "classic", "zeroBits": "exchange"}),
}


def chain_of(values: dict) -> ChainSettings:
    return ChainSettings(values["prefix"], values["maxLevel"], values["resolutionMs"],
                         values.get("queueType", "quorum"), values.get("zeroBits", "queue"))


def waiting_in_chain(chain: ChainSettings) -> int:
    t = build(chain)
    with connect() as c:
        ch = c.channel()
        return sum(ch.queue_declare(q.name, passive=True).method.message_count
                   for q in t.queues if t.in_chain(q.name))


def publish(prefix: str, sent: dict, stop: threading.Event) -> None:
    rng = random.Random(11)
    start = time.monotonic()
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for i in range(MESSAGES):
            time.sleep(max(0.0, start + i * SPREAD_S / MESSAGES - time.monotonic()))
            delay = rng.randrange(0, MAX_DELAY_MS)
            before = now_ms()
            ch.basic_publish(f"{prefix}.check-in", f"upgrade.{i}", json.dumps({"id": i}).encode(),
                             pika.BasicProperties(headers={"x-delay": delay}, delivery_mode=2), mandatory=True)
            sent[i] = before + delay  # due, judged from before the publish
            if stop.is_set():
                return


def receive(chain: ChainSettings, got: list, ready: threading.Event, stop: threading.Event) -> None:
    receiver = Receiver(chain, "upgrade.#", messages=got)  # `got` fills as messages arrive
    ready.set()
    try:
        while not stop.is_set():
            receiver.collect(len(got) + 1, timeout=0.2)
    finally:
        receiver.close()


def roll(kubelet: Kubelet, old_pods: list, deployment: dict, docs: list) -> list:
    """RollingUpdate with maxSurge 1, maxUnavailable 0."""
    new_pods = []
    for old in old_pods:
        new_pods.append(kubelet.start(deployment, docs).wait_ready())
        old.terminate()
    return new_pods


@pytest.mark.parametrize("old,new", SCENARIOS.values(), ids=SCENARIOS.keys())
@pytest.mark.brokers("rmq3.10", "rmq4.3", reason="runs the chart's containers as processes; the chain change itself is "
                                                 "test_live_change.py's, on every version; 20 s")
def test_helm_upgrade_changes_the_chain_without_losing_or_delaying_a_message(broker, tmp_path, old, new):
    prefix = unique_prefix()
    # (holdWithinMs 2000, not the default 10 s: half the messages take the shorter path, held by
    # the distributor pods as they roll, and half wait in the chain being changed, the test's point)
    common = {"prefix": prefix, "checkIn": {"replicas": 2}, "distributor": {"replicas": 2}, "holdWithinMs": 2000,
              "test": {"delayMs": 500, "timeoutSeconds": 30}}
    old_values, new_values = {**common, **old}, {**common, **new}
    old_docs, new_docs = render(old_values), render(new_values)
    old_chain, new_chain = chain_of(old_values), chain_of(new_values)
    parts = urlsplit(broker_url())
    url = urlunsplit(parts._replace(netloc=f"{parts.username}@{parts.hostname}:{parts.port or 5672}"))
    kubelet = Kubelet(tmp_path, {"delay-gateway-broker": {"url": url, "password": parts.password}})
    stop, ready = threading.Event(), threading.Event()
    sent, got = {}, []
    try:
        # 1. install
        old_pods = {name: [kubelet.start(d, old_docs) for _ in range(d["spec"]["replicas"])]
                    for name, d in by_kind(old_docs, "Deployment").items()}
        for pods in old_pods.values():
            for pod in pods:
                pod.wait_ready()
        [job] = by_kind(old_docs, "Job").values()
        assert kubelet.run_to_completion(job, old_docs).returncode == 0
        # 2. messages, all along
        receiver = threading.Thread(target=receive, args=(old_chain, got, ready, stop), daemon=True)
        receiver.start()
        assert ready.wait(10)
        publisher = threading.Thread(target=publish, args=(prefix, sent, stop), daemon=True)
        publisher.start()
        time.sleep(UPGRADE_AT_S)  # the upgrade comes mid-traffic: a chosen moment, not a wait
        waiting_before = waiting_in_chain(old_chain)
        # 3. upgrade: the pre-upgrade hook, then both Deployments roll
        [job] = by_kind(new_docs, "Job").values()
        declared = kubelet.run_to_completion(job, new_docs)
        assert declared.returncode == 0, declared.stderr
        new_pods, errors, threads = {}, [], []

        def rollout(name: str, deployment: dict) -> None:
            try:
                new_pods[name] = roll(kubelet, old_pods[name], deployment, new_docs)
            except Exception as exc:  # reported below, in the test's thread
                errors.append(f"{name}: {exc}")

        for name, deployment in by_kind(new_docs, "Deployment").items():
            threads.append(threading.Thread(target=rollout, args=(name, deployment)))
            threads[-1].start()
        for t in threads:
            t.join(60)
        assert not errors and sorted(new_pods) == sorted(old_pods), errors or "a rollout did not finish"
        exits = [pod.wait() for pods in old_pods.values() for pod in pods]
        assert exits == [0] * len(exits), [p.logs()[-1500:] for ps in old_pods.values() for p in ps]
        publisher.join(SPREAD_S + 10)
        # 4. everything arrives
        wait_until(lambda: len({json.loads(m.body)["id"] for m in list(got)}) >= MESSAGES,
                   (max(sent.values()) - now_ms()) / 1000 + 5, 0.2, fail=False)  # (what is lost is counted below)
        stop.set()
        receiver.join(10)
        # helm test, on the upgraded release
        [test_pod] = by_kind(new_docs, "Pod").values()
        tested = kubelet.run_to_completion(test_pod, new_docs, timeout=60)
    finally:
        stop.set()
        kubelet.stop_all()
    try:
        arrivals = {}
        for m in got:
            arrivals.setdefault(json.loads(m.body)["id"], []).append(m.at_ms)
        lost = sorted(set(sent) - set(arrivals))
        early = sorted(i for i, times in arrivals.items() if min(times) < sent[i])
        lateness = sorted(min(times) - sent[i] for i, times in arrivals.items())
        duplicates = sum(len(t) - 1 for t in arrivals.values())
        print(f"upgrade {old} -> {new}: {len(sent)} sent, {waiting_before} waiting in the old chain at the upgrade, "
              f"{len(arrivals)} delivered, {len(lost)} lost, {len(early)} early, {duplicates} duplicates, "
              f"lateness p50 {quantiles(lateness, n=100)[49]:.0f} ms, p99 {quantiles(lateness, n=100)[98]:.0f} ms, "
              f"max {lateness[-1]} ms")
        assert len(sent) == MESSAGES and waiting_before > 0
        assert lost == [] and early == []
        assert lateness[-1] <= LATE_BOUND_MS
        # the old chain drained by itself into the shared distributor and returning queues
        assert waiting_in_chain(old_chain) == 0
        assert tested.returncode == 0, tested.stdout + tested.stderr
        assert json.loads(tested.stdout.splitlines()[-1])["delivered"] is True
    finally:
        for chain in (old_chain, new_chain):
            remove(chain)
