"""Checkpoint SDK for training code: tell Muster where the newest checkpoint is, and hear
when Muster (or Kubernetes via SIGTERM) wants one now. No torch, no asyncio in your code.

Environment (set by the agent's backend on every replica):

- `MUSTER_JOB_ID`, `MUSTER_ATTEMPT`: who we are.
- `MUSTER_CHECKPOINT_URI`: where to write checkpoints (a prefix; `checkpoint_uri(step)` gives
  `<prefix>/step-<step>`, the layout the fake backend uses too). The broker makes it this
  attempt's own prefix, `<checkpoint.uri>/attempt-<n>`, so a late write of an older attempt
  (still in its termination grace) never lands among this attempt's checkpoints; a report
  under another attempt's prefix is refused.
- `MUSTER_RESUME_FROM`: the checkpoint to start from: a bare URI (what the kube backend sets),
  or JSON `{"step": N, "uri": "...", "attempt": A}`, or empty for a fresh start.
  `MUSTER_RESUME_STEP` gives the step (without it the step is read from the JSON or from a
  trailing `step-N` in the URI), `MUSTER_RESUME_ATTEMPT` the attempt that wrote it: resume
  from exactly that checkpoint, never from "the highest step under the location".
- `MUSTER_REPORT_URL`: the kube agent's checkpoint report endpoint (set on every replica the
  kube backend creates). Reports are POSTed there as JSON `{job_id, attempt, step, uri,
  token}` with the attempt's `MUSTER_CHECKPOINT_TOKEN`, retried briefly; the pod needs no
  Kubernetes RBAC and no NATS. A refusal (4xx: wrong token, an attempt that has ended) raises
  `CheckpointRefused` with the agent's reason; an agent that cannot be reached falls back to
  the routes below.
- `MUSTER_NATS_URL`, `MUSTER_SUBJECT_PREFIX` (default `muster`): when set, reports go out as a
  JSON `schemas.agent.CheckpointReport` on `<prefix>.checkpoint.<job_id>`, with the attempt's
  `MUSTER_CHECKPOINT_TOKEN`. Requests never come over NATS: every workload shares one NATS
  user, so any subject a workload could subscribe to, every workload could; the agent hands a
  request only to its own attempt's pods (the podinfo file below) and SIGTERM.
- `MUSTER_ANNOTATION_FILE`: without NATS, `report_checkpoint` writes the JSON `{"step", "uri"}`
  to this file. The kube backend reads that value from the pod annotation
  `muster.dev/checkpoint` (`ANNOTATION`); a sidecar, or the workload itself when its
  ServiceAccount may patch its own pod, copies the file into the annotation.
- `MUSTER_PODINFO_DIR`: the kube backend's downward-API volume. Its `annotations` file gets
  `muster.dev/checkpoint-request="<deadline>"` when the agent asks for a checkpoint; the SDK
  polls it (every `MUSTER_PODINFO_POLL_S`, default 2 s). The local backend writes the same
  file in the attempt's directory.
- `MUSTER_SIGTERM_GRACE_S` (default 30): the deadline given to a SIGTERM checkpoint request.
- `KUBERNETES_SERVICE_HOST` (or `MUSTER_FENCE_URL`), `MUSTER_FENCE_POLL_S`: the in-pod
  self-fence, `start_self_fence()` / `FenceWatch`: reads the cluster's fence Lease
  (`muster-fence`) and stops this process (SIGTERM) once the newest deadline it saw has passed,
  before the broker could start the job elsewhere.
- `MUSTER_CHECKPOINT_INTERVAL_S`: the broker's advised seconds between checkpoints for the pool
  this attempt runs on (Young/Daly from the pool's reclaim rate and the job's
  `checkpoint.cost_s`); `advised_interval_s()` reads it. Absent: no advice, keep your own.

Typical loop::

    from agents import sdk

    ck = sdk.Checkpointer()
    ck.on_checkpoint_request(lambda req: None)  # or just poll ck.requested
    for step in range(ck.resume_step, total):
        train_one_step()
        if step % 100 == 0 or ck.requested:
            save(ck.checkpoint_uri(step))
            ck.report_checkpoint(step)
            if ck.requested and ck.sigterm_received:
                break  # Kubernetes is stopping us; the checkpoint is saved
            ck.clear_request()

NATS (reports only) runs on a private daemon thread with its own event loop; request callbacks
run on the podinfo poller's thread (or, for SIGTERM, in the main thread's signal handler), so
keep them short.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import ssl
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypeVar

import msgspec

from schemas.agent import CheckpointNow, CheckpointRef, CheckpointReport
from schemas.codec import encode_json
from schemas.subjects import Subjects
from shell.natsio import flush

ANNOTATION = "muster.dev/checkpoint"
ENV_JOB_ID = "MUSTER_JOB_ID"
ENV_ATTEMPT = "MUSTER_ATTEMPT"
ENV_CHECKPOINT_URI = "MUSTER_CHECKPOINT_URI"
ENV_RESUME_FROM = "MUSTER_RESUME_FROM"
ENV_RESUME_STEP = "MUSTER_RESUME_STEP"
ENV_RESUME_ATTEMPT = "MUSTER_RESUME_ATTEMPT"
ENV_PODINFO_DIR = "MUSTER_PODINFO_DIR"
ANNOTATION_REQUEST = "muster.dev/checkpoint-request"
PODINFO_POLL_S = 2.0
ENV_NATS_URL = "MUSTER_NATS_URL"
ENV_SUBJECT_PREFIX = "MUSTER_SUBJECT_PREFIX"
ENV_ANNOTATION_FILE = "MUSTER_ANNOTATION_FILE"
ENV_SIGTERM_GRACE = "MUSTER_SIGTERM_GRACE_S"
ENV_PODINFO_POLL = "MUSTER_PODINFO_POLL_S"
ENV_CHECKPOINT_TOKEN = "MUSTER_CHECKPOINT_TOKEN"
ENV_CHECKPOINT_INTERVAL = "MUSTER_CHECKPOINT_INTERVAL_S"
ENV_REPORT_URL = "MUSTER_REPORT_URL"
# Pauses between tries of a report the agent did not answer (then the other routes).
REPORT_RETRY_S = (0.2, 0.5)

_STEP_RE = re.compile(r"step-(\d+)/?$")
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
_T = TypeVar("_T")
Channel = Literal["http", "nats", "file", "none"]
RequestCallback = Callable[[CheckpointNow], None]

log = logging.getLogger("muster.sdk")


class SdkConfigError(ValueError):
    """An environment variable Muster set (or you set) is malformed; the text names it."""


class CheckpointRefused(RuntimeError):
    """The agent answered the report with a refusal (4xx); the text is its reason. Sending
    it again, or by another route, would be refused too."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"checkpoint report refused ({status}): {reason}")
        self.status = status
        self.reason = reason


def parse_resume_from(text: str | None) -> CheckpointRef | None:
    """`MUSTER_RESUME_FROM` as JSON {step, uri}, a bare URI (step from `step-N`), or empty."""
    if text is None or not text.strip():
        return None
    raw = text.strip()
    if raw.startswith("{"):
        try:
            ref = msgspec.json.decode(raw, type=CheckpointRef)
        except msgspec.MsgspecError as exc:
            raise SdkConfigError(f"{ENV_RESUME_FROM}: not a {{step, uri}} object: {exc}") from None
        if ref.step < 0:
            raise SdkConfigError(f"{ENV_RESUME_FROM}: step must be >= 0, got {ref.step}")
        return ref
    m = _STEP_RE.search(raw)
    return CheckpointRef(step=int(m.group(1)) if m else 0, uri=raw)


@dataclass(frozen=True, slots=True)
class SdkEnv:
    """The SDK's view of the environment, validated once."""

    job_id: str | None = None
    attempt: int | None = None
    checkpoint_uri: str | None = None
    resume_from: CheckpointRef | None = None
    nats_url: str | None = None
    subject_prefix: str = "muster"
    annotation_file: str | None = None
    sigterm_grace_s: float = 30.0
    podinfo_dir: str | None = None
    podinfo_poll_s: float = PODINFO_POLL_S
    checkpoint_token: str = ""
    checkpoint_interval_s: float | None = None
    report_url: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SdkEnv:
        e = os.environ if env is None else env

        def get(name: str) -> str | None:
            v = e.get(name)
            return v.strip() if v is not None and v.strip() else None

        job_id = get(ENV_JOB_ID)
        if job_id is not None and not _JOB_RE.match(job_id):
            raise SdkConfigError(
                f"{ENV_JOB_ID}={job_id!r}: use letters, digits, '-' and '_' (at most 63)"
            )
        attempt: int | None = None
        if (a := get(ENV_ATTEMPT)) is not None:
            try:
                attempt = int(a)
            except ValueError:
                raise SdkConfigError(f"{ENV_ATTEMPT}={a!r} is not an integer") from None
            if attempt < 1:
                raise SdkConfigError(f"{ENV_ATTEMPT}={attempt} must be >= 1")
        prefix = get(ENV_SUBJECT_PREFIX) or "muster"
        if not _PREFIX_RE.match(prefix):
            raise SdkConfigError(f"{ENV_SUBJECT_PREFIX}={prefix!r} is not a NATS subject prefix")
        resume = parse_resume_from(e.get(ENV_RESUME_FROM))
        if resume is not None and (rs := get(ENV_RESUME_STEP)) is not None:
            try:
                step = int(rs)
            except ValueError:
                raise SdkConfigError(f"{ENV_RESUME_STEP}={rs!r} is not an integer") from None
            if step < 0:
                raise SdkConfigError(f"{ENV_RESUME_STEP}={step} must be >= 0")
            resume = msgspec.structs.replace(resume, step=step)
        if resume is not None and (ra := get(ENV_RESUME_ATTEMPT)) is not None:
            if not ra.isdigit():
                raise SdkConfigError(f"{ENV_RESUME_ATTEMPT}={ra!r} is not an attempt number")
            resume = msgspec.structs.replace(resume, attempt=int(ra))
        grace = 30.0
        if (g := get(ENV_SIGTERM_GRACE)) is not None:
            try:
                grace = float(g)
            except ValueError:
                raise SdkConfigError(f"{ENV_SIGTERM_GRACE}={g!r} is not a number") from None
        poll = PODINFO_POLL_S
        if (p := get(ENV_PODINFO_POLL)) is not None:
            try:
                poll = float(p)
            except ValueError:
                raise SdkConfigError(f"{ENV_PODINFO_POLL}={p!r} is not a number") from None
            if not 0.01 <= poll <= 60:
                raise SdkConfigError(f"{ENV_PODINFO_POLL}={poll} must be between 0.01 and 60")
        iv = get(ENV_CHECKPOINT_INTERVAL)
        interval = None if iv is None else _positive_seconds(ENV_CHECKPOINT_INTERVAL, iv)
        report_url = get(ENV_REPORT_URL)
        if report_url is not None and not report_url.startswith(("http://", "https://")):
            raise SdkConfigError(f"{ENV_REPORT_URL}={report_url!r} is not an http(s) URL")
        return cls(
            job_id=job_id,
            attempt=attempt,
            checkpoint_uri=get(ENV_CHECKPOINT_URI),
            resume_from=resume,
            nats_url=get(ENV_NATS_URL),
            subject_prefix=prefix,
            annotation_file=get(ENV_ANNOTATION_FILE),
            sigterm_grace_s=grace,
            podinfo_dir=get(ENV_PODINFO_DIR),
            podinfo_poll_s=poll,
            checkpoint_token=get(ENV_CHECKPOINT_TOKEN) or "",
            checkpoint_interval_s=interval,
            report_url=report_url,
        )

    @property
    def resume_step(self) -> int:
        return self.resume_from.step if self.resume_from is not None else 0


def _positive_seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SdkConfigError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise SdkConfigError(f"{name}={text!r} must be a positive number of seconds")
    return value


def annotation_value(step: int, uri: str, job_id: str = "", attempt: int = 0) -> str:
    """The value of the `muster.dev/checkpoint` pod annotation: JSON {"step", "uri"}, and the
    attempt that wrote it when known (the agent ignores a value naming another attempt)."""
    value: dict[str, object] = {"step": int(step), "uri": uri}
    if job_id and attempt:
        value |= {"job_id": job_id, "attempt": int(attempt)}
    return json.dumps(value, separators=(",", ":"))


def write_annotation_file(
    path: str | os.PathLike[str], step: int, uri: str, job_id: str = "", attempt: int = 0
) -> None:
    """Atomic write (temp file + rename) so a reader never sees half a value."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".muster-ckpt-", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(annotation_value(step, uri, job_id, attempt))
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def post_report(url: str, body: bytes, timeout: float) -> None:
    """POST one report to the agent, retried (`REPORT_RETRY_S`) while it cannot be reached
    or answers 5xx, all within `timeout`. Raises CheckpointRefused on a 4xx, OSError when
    no try got through."""
    deadline = time.monotonic() + timeout
    # Straight to the agent: it is in the pod's own cluster, never behind HTTP(S)_PROXY.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    for pause in (*REPORT_RETRY_S, None):
        left = deadline - time.monotonic()
        try:
            with opener.open(request, timeout=max(left, 0.05)) as resp:
                resp.read()
                return
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500:
                raise CheckpointRefused(exc.code, _refusal(exc)) from None
            error: OSError = exc
        except OSError as exc:  # URLError, timeouts, resets
            error = exc
        if pause is None or time.monotonic() + pause >= deadline:
            raise error
        time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


def _refusal(exc: urllib.error.HTTPError) -> str:
    """The agent's reason (`{"error": ...}`), else the status line."""
    with contextlib.suppress(Exception):
        reason = json.loads(exc.read(4096)).get("error")
        if isinstance(reason, str) and reason:
            return reason
    return str(exc.reason)


def checkpoint_request_line(deadline: float) -> str:
    """One line of a downward-API `annotations` file asking for a checkpoint by `deadline`."""
    return f"{ANNOTATION_REQUEST}={json.dumps(str(deadline))}"


def read_checkpoint_request(annotations_file: str | os.PathLike[str]) -> float | None:
    """The deadline in a downward-API `annotations` file (`key="value"` lines), or None."""
    try:
        text = Path(annotations_file).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or key.strip() != ANNOTATION_REQUEST:
            continue
        try:
            value = json.loads(raw.strip())
            return float(value)
        except (ValueError, TypeError):
            return None
    return None


class _Bridge:
    """A daemon thread running an event loop with one NATS connection (lazy)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="muster-sdk", daemon=True)
        self.thread.start()
        self.nc: Any = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def client(self) -> Any:
        if self.nc is None or self.nc.is_closed:
            import nats  # only when NATS is configured

            self.nc = await nats.connect(
                self.url, connect_timeout=5, max_reconnect_attempts=-1, reconnect_time_wait=0.5
            )
        return self.nc

    def close(self, timeout: float = 5.0) -> None:
        async def _close() -> None:
            if self.nc is not None and not self.nc.is_closed:
                with contextlib.suppress(Exception):
                    await self.nc.drain()

        with contextlib.suppress(Exception):
            self.call(_close(), timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


class Checkpointer:
    """Report checkpoints and receive checkpoint requests (see the module docstring)."""

    def __init__(self, env: SdkEnv | None = None) -> None:
        self.env = env if env is not None else SdkEnv.from_env()
        self.subjects = Subjects(prefix=self.env.subject_prefix)
        self._requested = threading.Event()
        self.sigterm_received = False
        self._callbacks: list[RequestCallback] = []
        self._bridge: _Bridge | None = None
        self._lock = threading.Lock()
        self._prev_sigterm: Any = None
        self.last_request: CheckpointNow | None = None
        self._poller: threading.Thread | None = None
        self._closed = threading.Event()

    # -- what the training loop needs ----------------------------------------------------
    @property
    def resume_from(self) -> CheckpointRef | None:
        return self.env.resume_from

    @property
    def resume_step(self) -> int:
        return self.env.resume_step

    def advised_interval_s(self, default: float | None = None) -> float | None:
        """Seconds between checkpoints the broker advises for this attempt's pool, else
        `default`. Each attempt gets the value for where it runs."""
        advised = self.env.checkpoint_interval_s
        return advised if advised is not None else default

    def checkpoint_uri(self, step: int) -> str:
        """`<MUSTER_CHECKPOINT_URI>/step-<step>` (empty prefix gives `step-<step>`)."""
        base = (self.env.checkpoint_uri or "").rstrip("/")
        return f"{base}/step-{step}" if base else f"step-{step}"

    @property
    def requested(self) -> bool:
        """True once a checkpoint was asked for (NATS or SIGTERM) until `clear_request()`."""
        return self._requested.is_set()

    def wait_for_request(self, timeout: float | None = None) -> bool:
        return self._requested.wait(timeout)

    def clear_request(self) -> None:
        self._requested.clear()

    @property
    def nats_enabled(self) -> bool:
        return bool(self.env.nats_url and self.env.job_id)

    def report_checkpoint(self, step: int, uri: str | None = None, timeout: float = 5.0) -> Channel:
        """Tell Muster the newest checkpoint; returns the channel used. Tries the agent's
        endpoint first; raises CheckpointRefused when it refuses, and on NATS errors (the
        training loop decides whether a failed report matters)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        where = uri if uri is not None else self.checkpoint_uri(step)
        if self.env.report_url and self.env.job_id:
            body = json.dumps(
                {
                    "job_id": self.env.job_id,
                    "attempt": self.env.attempt or 1,
                    "step": step,
                    "uri": where,
                    "token": self.env.checkpoint_token,
                }
            ).encode()
            try:
                post_report(self.env.report_url, body, timeout)
                return "http"
            except OSError as exc:
                log.warning(
                    "checkpoint report to %s failed (%s); trying the other routes",
                    self.env.report_url,
                    exc,
                )
        if self.nats_enabled:
            assert self.env.job_id is not None
            report = CheckpointReport(
                job_id=self.env.job_id,
                attempt=self.env.attempt or 1,
                step=step,
                uri=where,
                at=time.time(),
                token=self.env.checkpoint_token,
            )
            subject = self.subjects.checkpoint(self.env.job_id)
            bridge = self._ensure_bridge()

            async def _pub() -> None:
                nc = await bridge.client()
                await nc.publish(subject, encode_json(report))
                await flush(nc, timeout)

            bridge.call(_pub(), timeout + 5)
            return "nats"
        if self.env.annotation_file:
            write_annotation_file(
                self.env.annotation_file, step, where, self.env.job_id or "", self.env.attempt or 0
            )
            return "file"
        log.warning(
            "no %s, %s or %s reached; checkpoint report not delivered",
            ENV_REPORT_URL,
            ENV_NATS_URL,
            ENV_ANNOTATION_FILE,
        )
        return "none"

    def on_checkpoint_request(
        self, callback: RequestCallback | None = None, *, sigterm: bool = True
    ) -> None:
        """Call `callback(CheckpointNow)` (and set `requested`) when Muster asks for a
        checkpoint of this attempt; with `sigterm`, SIGTERM counts as a request too."""
        if callback is not None:
            with self._lock:
                self._callbacks.append(callback)
        if sigterm:
            self.install_sigterm_handler()
        if self.env.podinfo_dir and self._poller is None:
            self._poller = threading.Thread(
                target=self._poll_podinfo, name="muster-sdk-podinfo", daemon=True
            )
            self._poller.start()

    def install_sigterm_handler(self) -> bool:
        """Map SIGTERM to a checkpoint request (main thread only); returns whether installed.
        The process is not stopped: the loop saves a checkpoint and exits on its own."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("SIGTERM handler not installed: not on the main thread")
            return False
        if self._prev_sigterm is None:
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        return True

    def uninstall_sigterm_handler(self) -> None:
        if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None

    def close(self) -> None:
        self._closed.set()
        if self._poller is not None:
            self._poller.join(self.env.podinfo_poll_s + 1.0)
            self._poller = None
        self.uninstall_sigterm_handler()
        bridge, self._bridge = self._bridge, None
        if bridge is not None:
            bridge.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _ensure_bridge(self) -> _Bridge:
        with self._lock:
            if self._bridge is None:
                assert self.env.nats_url is not None
                self._bridge = _Bridge(self.env.nats_url)
            return self._bridge

    def _deliver(self, req: CheckpointNow) -> None:
        self.last_request = req
        self._requested.set()
        with self._lock:
            callbacks = list(self._callbacks)
        for cb in callbacks:
            try:
                cb(req)
            except Exception:
                log.exception("checkpoint request callback failed")

    def _poll_podinfo(self) -> None:
        """Slow path for kube: watch the downward-API file for a new request deadline (one
        whose deadline has passed is ignored)."""
        assert self.env.podinfo_dir is not None
        path = Path(self.env.podinfo_dir) / "annotations"
        seen: float | None = None
        while not self._closed.wait(self.env.podinfo_poll_s):
            deadline = read_checkpoint_request(path)
            if deadline is not None and deadline != seen and deadline > time.time():
                seen = deadline
                self._deliver(
                    CheckpointNow(
                        job_id=self.env.job_id or "local",
                        attempt=self.env.attempt or 1,
                        epoch=0,
                        deadline=deadline,
                    )
                )

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Runs in the main thread between two of its bytecodes, possibly inside
        `clear_request()` or another section holding a lock `_deliver` takes: delivering here
        could deadlock, so a thread of its own delivers."""
        self.sigterm_received = True
        req = CheckpointNow(
            job_id=self.env.job_id or "local",
            attempt=self.env.attempt or 1,
            epoch=0,
            deadline=time.time() + self.env.sigterm_grace_s,
        )
        threading.Thread(
            target=self._deliver, args=(req,), name="muster-sigterm", daemon=True
        ).start()
        prev = self._prev_sigterm
        if callable(prev):
            prev(signum, frame)


SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
ENV_FENCE_URL = "MUSTER_FENCE_URL"
ENV_FENCE_POLL = "MUSTER_FENCE_POLL_S"
FENCE_LEASE = "muster-fence"  # agents/kube/fence.py LEASE_NAME
FENCED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped by the fence, not by an error of the job


def fence_url(env: Mapping[str, str] | None = None, sa_dir: str = SA_DIR) -> str | None:
    """Where the cluster's fence Lease is: `MUSTER_FENCE_URL`, else the in-cluster API server
    and this pod's own namespace; None outside a cluster."""
    e = os.environ if env is None else env
    if e.get(ENV_FENCE_URL):
        return e[ENV_FENCE_URL]
    host, port = e.get("KUBERNETES_SERVICE_HOST"), e.get("KUBERNETES_SERVICE_PORT", "443")
    try:
        namespace = Path(sa_dir, "namespace").read_text().strip()
    except OSError:
        return None
    if not host or not namespace:
        return None
    return (
        f"https://{host}:{port}/apis/coordination.k8s.io/v1/namespaces/{namespace}"
        f"/leases/{FENCE_LEASE}"
    )


class FenceWatch:
    """The in-pod self-fence: when the whole cluster is cut off, the broker re-dispatches this
    job elsewhere once the cluster's fence Lease has lapsed (plus a lead that covers the
    termination grace). The watch reads that Lease now and then and remembers the newest
    deadline it saw; once the clock passes it, `lapsed()` is true and `run` calls `on_lapse`
    (by default: SIGTERM to this process, so the job stops before a second copy can start).
    A read that fails (API server away) keeps the last deadline: an outage shorter than the
    window stops nothing. No Lease (404): the cluster is not fenced, nothing stops. Reading
    needs `get` on `leases` for the pod's ServiceAccount (docs/kubernetes.md)."""

    def __init__(
        self,
        url: str,
        *,
        token_file: str = f"{SA_DIR}/token",
        ca_file: str = f"{SA_DIR}/ca.crt",
        clock: Callable[[], float] = time.time,
        timeout_s: float = 10.0,
    ) -> None:
        self.url = url
        self.token_file = token_file
        self.ca_file = ca_file
        self._clock = clock
        self.timeout_s = timeout_s
        self.until: float | None = None  # the newest deadline read
        self.absent = False  # the Lease does not exist: nothing to enforce
        self.failures = 0

    def refresh(self) -> float | None:
        """Read the Lease once; the newest deadline known afterwards."""
        headers = {"Accept": "application/json"}
        with contextlib.suppress(OSError):
            headers["Authorization"] = "Bearer " + Path(self.token_file).read_text().strip()
        context = None
        if self.url.startswith("https:") and Path(self.ca_file).exists():
            context = ssl.create_default_context(cafile=self.ca_file)
        request = urllib.request.Request(self.url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=context) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            self.absent = exc.code == 404
            if exc.code != 404:
                self.failures += 1
            return self.until
        except (OSError, ValueError):
            self.failures += 1
            return self.until
        self.absent = False
        until = _lease_deadline(body)
        if until is not None and (self.until is None or until > self.until):
            self.until = until
        return self.until

    def lapsed(self) -> bool:
        return not self.absent and self.until is not None and self._clock() >= self.until

    def run(
        self,
        stop: threading.Event,
        poll_s: float = 30.0,
        on_lapse: Callable[[], None] | None = None,
    ) -> None:
        """Refresh every `poll_s` and check the deadline every second until `stop`; call
        `on_lapse` once when the fence lapsed."""
        next_read = 0.0
        while not stop.is_set():
            if self._clock() >= next_read:
                self.refresh()
                next_read = self._clock() + poll_s
            if self.lapsed():
                log.error("fence lapsed: the cluster lost its broker; stopping this attempt")
                (on_lapse or _stop_self)()
                return
            stop.wait(min(1.0, poll_s))


def _lease_deadline(body: Any) -> float | None:
    """The deadline of a Lease as the agent writes it (agents/kube/fence.py)."""
    if not isinstance(body, dict):
        return None
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return float(annotations["muster.dev/fence-until"])
    return None


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def start_self_fence(
    env: Mapping[str, str] | None = None, on_lapse: Callable[[], None] | None = None
) -> FenceWatch | None:
    """Start the in-pod self-fence on a daemon thread when the pod can find its cluster's
    fence; None outside a cluster. `MUSTER_FENCE_POLL_S` (default 30) sets how often the
    Lease is read."""
    e = os.environ if env is None else env
    url = fence_url(e)
    if url is None:
        return None
    poll = _positive_seconds(ENV_FENCE_POLL, e[ENV_FENCE_POLL]) if e.get(ENV_FENCE_POLL) else 30.0
    watch = FenceWatch(url)
    threading.Thread(
        target=watch.run,
        args=(threading.Event(), poll, on_lapse),
        name="muster-self-fence",
        daemon=True,
    ).start()
    return watch


_default: Checkpointer | None = None
_default_lock = threading.Lock()


def default() -> Checkpointer:
    """The process-wide Checkpointer built from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Checkpointer()
        return _default


def report_checkpoint(step: int, uri: str | None = None) -> Channel:
    return default().report_checkpoint(step, uri)


def on_checkpoint_request(callback: RequestCallback | None = None, *, sigterm: bool = True) -> None:
    default().on_checkpoint_request(callback, sigterm=sigterm)


def checkpoint_requested() -> bool:
    return default().requested


def resume_from() -> CheckpointRef | None:
    return default().resume_from
