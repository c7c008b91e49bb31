"""Durable job records in a JetStream key-value bucket (one key per job).

Writes go out with `publish_async` so many records persist concurrently; a caller awaits the
acks of exactly the records it depends on (a submission's ack, a dispatch's send).
"""

from __future__ import annotations

import asyncio

import structlog
from nats.js import api
from nats.js.client import JetStreamContext

from broker.core.records import JobRecord, record_decoder, record_encoder

log = structlog.get_logger("muster.store")

KV_OP = "KV-Operation"


class JobStore:
    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        self.js = js
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, replicas: int = 1) -> JobStore:
        try:
            await js.key_value(bucket)
        except Exception:
            await js.create_key_value(
                bucket=bucket,
                history=1,
                storage=api.StorageType.FILE,
                replicas=replicas,
                description="Muster job records",
            )
        return cls(js, bucket)

    async def put(self, record: JobRecord) -> None:
        await self.put_many([record])

    async def put_many(self, records: list[JobRecord]) -> None:
        """Persist records concurrently; returns when every one is acknowledged."""
        if not records:
            return
        futures = []
        for record in records:
            data = record_encoder.encode(record)
            futures.append(await self.js.publish_async(self.prefix + record.job_id, data))
        await asyncio.gather(*futures)

    async def delete(self, job_id: str) -> None:
        await self.js.publish(self.prefix + job_id, b"", headers={KV_OP: "DEL"})

    async def load_all(self, limit_s: float = 60.0) -> list[JobRecord]:
        """Read the newest record of every job (an ordered consumer, last per subject)."""
        info = await self.js.stream_info(self.stream)
        if not info.state.messages:
            return []
        sub = await self.js.subscribe(
            self.prefix + ">",
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=1024 * 1024 * 1024,
        )
        records: list[JobRecord] = []
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + limit_s
            while True:
                msg = await sub.next_msg(timeout=max(0.1, deadline - loop.time()))
                op = msg.headers.get(KV_OP) if msg.headers else None
                if op is None and msg.data:
                    try:
                        records.append(record_decoder.decode(msg.data))
                    except Exception as exc:  # a corrupt record must not stop recovery
                        log.error("store.corrupt_record", subject=msg.subject, error=str(exc))
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return records
