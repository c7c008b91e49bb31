"""Backup and restore of the job bucket (`muster jobs-backup` / `muster jobs-restore`).

A backup is a JSON-lines file: a header (format, bucket, subject prefix, record count, the
bucket's last stream sequence, when) and one line per job with its record exactly as the
bucket stores it (msgpack, base64). It is taken from a live bucket without stopping the broker:
each record is the newest as of the moment the backup caught up with the bucket.

A restore writes every record into the job bucket (created with the broker config's replicas
and placement when it is missing) and refuses a bucket that already holds records unless told
to replace them: merging two histories of the same jobs is never right. Restore with no broker
leading (scale the brokers to zero), then start them: the leader restores every job from the
bucket as a takeover does, and re-sends the dispatches the records hold unacknowledged. What
happened after the backup was taken is not in it (docs/operations.md, "Backup and restore").
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from broker.core.records import RECORD_FORMAT, JobRecord, record_decoder, record_encoder
from broker.store import JobStore, NewerRecords
from schemas.config import BrokerConfig
from schemas.subjects import Subjects

FORMAT = "muster-jobs-backup/1"


class BackupError(Exception):
    """A backup file or a bucket that cannot be used as asked; says how to fix it."""


@dataclass
class BackupInfo:
    records: int
    last_seq: int


async def backup(nc: Client, config: BrokerConfig, path: Path) -> BackupInfo:
    """Write every job record of the bucket to `path` (atomically: a temp file renamed)."""
    subjects = Subjects(prefix=config.subject_prefix)
    js = nc.jetstream()
    store = JobStore(js, subjects.jobs_bucket, nc)
    try:
        info = await js.stream_info(store.stream)
    except NotFoundError:
        raise BackupError(
            f"no job bucket {subjects.jobs_bucket} on this NATS: check --nats and the subject "
            f"prefix ({config.subject_prefix!r}, from the broker config)"
        ) from None
    try:
        records = await store.load_all()
    except NewerRecords as exc:
        raise BackupError(f"not backed up: {exc}") from None
    header = {
        "format": FORMAT,
        "bucket": subjects.jobs_bucket,
        "subject_prefix": config.subject_prefix,
        "records": len(records),
        "last_seq": info.state.last_seq,
        "taken_at": time.time(),
    }
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for record in sorted(records, key=lambda r: r.order):
            value = base64.b64encode(record_encoder.encode(record)).decode()
            f.write(json.dumps({"job_id": record.job_id, "record": value}) + "\n")
    tmp.replace(path)
    return BackupInfo(len(records), info.state.last_seq)


def read_backup(path: Path, config: BrokerConfig) -> list[JobRecord]:
    """The records of a backup file, checked against the config it is restored under."""
    lines = path.read_text(encoding="utf-8").splitlines()
    try:
        header = json.loads(lines[0]) if lines else {}
    except ValueError:
        header = {}
    if header.get("format") != FORMAT:
        raise BackupError(f"{path} is not a Muster job backup (no {FORMAT!r} header line)")
    if header.get("subject_prefix") != config.subject_prefix:
        raise BackupError(
            f"{path} holds the jobs of subject prefix {header.get('subject_prefix')!r}, not "
            f"{config.subject_prefix!r}: restore it with that broker config"
        )
    records = []
    for n, line in enumerate(lines[1:], start=2):
        try:
            entry = json.loads(line)
            record = record_decoder.decode(base64.b64decode(entry["record"]))
        except Exception as exc:
            raise BackupError(f"{path}:{n}: not a job record ({exc}); the file is damaged") from exc
        if record.format > RECORD_FORMAT:
            raise BackupError(
                f"{path}:{n}: job {record.job_id} is a record of format {record.format}, newer "
                f"than the {RECORD_FORMAT} this release of Muster understands: restore it with "
                "the release that backed it up"
            )
        records.append(record)
    if len(records) != header.get("records"):
        raise BackupError(
            f"{path} says it holds {header.get('records')} records but has {len(records)}: "
            "the file is truncated"
        )
    return records


async def restore(
    nc: Client, config: BrokerConfig, path: Path, *, replace: bool = False
) -> BackupInfo:
    """Write a backup's records into the job bucket; see the module docstring."""
    records = read_backup(path, config)
    subjects = Subjects(prefix=config.subject_prefix)
    js = nc.jetstream()
    store = await JobStore.open(
        js,
        subjects.jobs_bucket,
        config.replication,
        nc,
        max_bytes=config.limits.jobs_bucket_max_bytes,
    )
    info = await js.stream_info(store.stream)
    if info.state.messages and not replace:
        raise BackupError(
            f"job bucket {subjects.jobs_bucket} is not empty ({info.state.messages} messages); "
            "restore into an empty bucket (stop the brokers and delete it: `nats kv del "
            f"{subjects.jobs_bucket}`), or pass --replace to overwrite the jobs it shares "
            "with the backup"
        )
    for at in range(0, len(records), 1000):
        await store.put_many(records[at : at + 1000])
    info = await js.stream_info(store.stream)
    return BackupInfo(len(records), info.state.last_seq)
