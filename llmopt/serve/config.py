"""ServerConfig: every knob of the HTTP layer (the engine keeps its own EngineConfig), validated once."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# A little longer than the common client timeouts (the openai client and `llmopt bench` wait 600 s), so a
# client that gives up first sees its own, clearer timeout; this is the backstop for clients that never do.
DEFAULT_REQUEST_TIMEOUT_S = 630.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None  # None: the MODEL argument as given
    api_keys: list[str] = []
    # API key -> priority class; that class is the key's default and ceiling (docs/SERVE.md)
    api_key_priorities: dict[str, int] = {}
    # admission control (429 beyond these; requests that can never fit get 400)
    max_waiting: int = Field(256, ge=1)  # requests beyond the engine's free slots and KV blocks
    max_queued_tokens: int = Field(262144, ge=1)  # prompt tokens of those requests
    retry_after_s: int = Field(1, ge=1)
    # degradation: at this many waiting requests only priority >= degrade_min_priority is admitted
    degrade_waiting: int | None = Field(None, ge=1)
    degrade_min_priority: int = 1
    # priorities
    enable_priorities: bool = True  # engine scheduling_policy="priority"
    priority_aging_s: float = Field(10.0, gt=0)  # one class of boost per this many seconds waited
    # timeouts and shutdown
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    warmup: bool = True
    # semantic cache (off by default: a cached answer is only right when the model would repeat it)
    semantic_cache: Literal["off", "exact", "similar"] = "off"
    semantic_cache_ttl_s: float = Field(300.0, gt=0)
    semantic_cache_threshold: float = Field(0.95, gt=0, le=1)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @model_validator(mode="after")
    def _check(self):
        if any(not k for k in self.api_keys):
            raise ValueError("API keys must not be empty")
        unknown = sorted(set(self.api_key_priorities) - set(self.api_keys))
        if unknown:
            raise ValueError("--api-key-priority names a key that is not an --api-key")
        if self.api_key_priorities and not self.enable_priorities:
            raise ValueError("--api-key-priority needs priority scheduling")
        return self
