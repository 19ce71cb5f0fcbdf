"""ServerState: what the HTTP handlers share (configs, engine loop, admission, metrics, readiness)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmopt.engine.config import EngineConfig
from llmopt.serve.admission import AdmissionController
from llmopt.serve.auth import ApiKeyAuth
from llmopt.serve.config import ServerConfig
from llmopt.serve.engine_loop import EngineLoop
from llmopt.serve.metrics import ServerMetrics
from llmopt.serve.prompts import PromptBuilder
from llmopt.serve.semantic_cache import SemanticCache


@dataclass
class ServerState:
    engine_config: EngineConfig
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    admission: AdmissionController
    auth: ApiKeyAuth
    engine_loop: EngineLoop
    cache: SemanticCache
    prompts: PromptBuilder | None = None  # set by the engine thread before `ready`
    ready: bool = False  # engine built and warm
    draining: bool = False  # shutting down: no new requests
    fatal: BaseException | None = None  # the engine could not start
    created: int = field(default_factory=lambda: int(time.time()))
