"""/score and /rerank on an embedding model: texts embedded once each (normalized, all of them in
one batch), then the cosine similarity of each pair (query, document)."""

from __future__ import annotations

from array import array

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.protocol_embeddings import RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.serving_common import now_s, until_disconnected
from pagedllm.entrypoints.openai.serving_embeddings import OpenAIServingEmbedding
from pagedllm.pooling_params import PoolingParams


class OpenAIServingScore(OpenAIServingEmbedding):
    id_prefix = "score"

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        request.model = self.models.check(request.model)
        return await self.answer(request, self._score_body(request, raw_request))

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        request.model = self.models.check(request.model)
        return await self.answer(request, self._rerank_body(request, raw_request))

    async def _score_body(self, request: ScoreRequest, raw_request: Request) -> dict:
        scores, tokens = await self._similarities(request.pairs(), request, raw_request)
        return {
            "id": self.response_id(request),
            "object": "list",
            "created": now_s(),
            "model": request.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def _rerank_body(self, request: RerankRequest, raw_request: Request) -> dict:
        pairs = [(request.query, d) for d in request.documents]
        scores, tokens = await self._similarities(pairs, request, raw_request)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        top = ranked[: request.top_n] if request.top_n else ranked
        results = [{"index": i, "document": {"text": request.documents[i]}, "relevance_score": scores[i]} for i in top]
        return {
            "id": self.response_id(request),
            "model": request.model,
            "usage": {"total_tokens": tokens},
            "results": results,
        }

    async def _similarities(
        self, pairs: list[tuple[str, str]], request: ScoreRequest | RerankRequest, raw_request: Request
    ) -> tuple[list[float], int]:
        """The cosine similarity of each pair, and the prompt tokens embedded (each text once)."""
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        self.check_count(len(texts), "distinct texts", "text_2" if isinstance(request, ScoreRequest) else "documents")
        params = PoolingParams(normalize=True, truncate_prompt_tokens=request.truncate_prompt_tokens)
        outputs = await until_disconnected(self._embed_all(texts, params, request.priority, raw_request), raw_request)
        vectors = {}
        for text, output in zip(texts, outputs):
            if output.outputs is None:
                raise RuntimeError(f"request {output.request_id} ended without an embedding ({output.finish_reason})")
            vectors[text] = array("f", output.outputs.raw)
        scores = [sum(x * y for x, y in zip(vectors[a], vectors[b])) for a, b in pairs]
        return scores, sum(len(o.prompt_token_ids) for o in outputs)
