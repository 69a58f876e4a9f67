"""A callable test agent that leaves a trace of where and when it ran: one model turn, a pause of
`item["pause_s"]` (to be caught running), then `<item["pid_dir"]>/<session_id>` holding its process id and
when it started and ended, and the model's answer."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from openai import OpenAI


def agent(item: dict[str, Any], base_url: str, api_key: str, session_id: str) -> str:
    """Ask the model once; write this process's id and the time span; return the model's answer."""
    start = time.time()
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item["prompt"]}])
    time.sleep(float(item.get("pause_s", 0)))
    Path(item["pid_dir"], session_id).write_text(f"{os.getpid()} {start} {time.time()}")
    return reply.choices[0].message.content or ""
