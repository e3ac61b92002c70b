"""/v1/models (``ModelServing``): the served models' cards, and each loaded adapter's, as the
caller's tenant may see them (a model outside its tenant is a 404, as one not served)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request

from prism_serve.api.cards import adapter_cards, model_cards
from prism_serve.api.serving import Serving, ServingState, tenant_of
from prism_serve.engine.config import DEFAULT_MODEL, DEFAULT_MODEL_HF_ID

__all__ = ["ModelServing", "public_source"]


class ModelServing(Serving):
    """``GET /v1/models`` and ``/v1/models/{id}``; ``cards`` also answers the admin routes."""

    def __init__(self, state: ServingState, sources: dict[str, str]) -> None:
        """``sources``: each configured model's weights source (shown by its public name only)."""
        super().__init__(state)
        self._roots = {name: public_source(source) for name, source in sources.items()}

    def cards(self, http: Request | None = None) -> list[dict[str, Any]]:
        """Every served model's card, or those the request's tenant may call."""
        cards = model_cards(self.runtime.status(), self._roots)
        cards += adapter_cards(self.runtime.adapters(), cards)
        tenant = tenant_of(http) if http is not None else None
        return [c for c in cards if tenant is None or tenant.may_use(c["id"])]

    def card(self, http: Request, model: str) -> dict[str, Any]:
        self.state.visible(http, model)
        self.runtime.tokenizer(model)  # UnknownModelError (404) for a name not served
        return next(c for c in self.cards() if c["id"] == model)


def public_source(source: str) -> str:
    """Where a model's weights come from, as /v1/models shows it: the Hugging Face id of the default
    model, a synthetic preset as configured, a file or directory by its name only (an absolute path
    tells clients about the server's filesystem and nothing they can use)."""
    if source == DEFAULT_MODEL:
        return DEFAULT_MODEL_HF_ID
    if source.startswith("random:"):
        return source
    return Path(source).name or source
