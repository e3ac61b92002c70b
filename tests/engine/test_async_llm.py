"""The async streaming interface the server uses."""

from __future__ import annotations

import asyncio

import pytest

from prism_serve.engine.async_llm import AsyncLLM
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.errors import EmptyPromptError, InvalidSamplingParamsError


@pytest.fixture
def async_llm(make_engine):
    llm = AsyncLLM(make_engine(num_kv_blocks=64, max_num_seqs=4))
    yield llm
    llm.shutdown()


async def collect(llm: AsyncLLM, prompt: str, params: SamplingParams) -> list:
    return [out async for out in llm.generate(prompt, params)]


def test_concurrent_streams_match_offline_outputs(async_llm, engine):
    prompts = ["The capital of France is", "Water boils at", "My favourite colour is"]
    params = SamplingParams(temperature=0, max_tokens=12)

    async def main():
        return await asyncio.gather(*(collect(async_llm, p, params) for p in prompts))

    streams = asyncio.run(main())
    for prompt, outs in zip(prompts, streams, strict=True):
        engine.add_request(prompt, params)
        final = None
        while engine.has_unfinished_requests():
            final = engine.step()[-1]
        assert outs[-1].finished and outs[-1].token_ids == final.token_ids
        assert "".join(o.delta_text for o in outs) == outs[-1].text == final.text
        assert len(outs) > 1, "outputs arrive token by token"


def test_leaving_a_stream_early_aborts_it_and_frees_its_blocks(async_llm):
    engine = async_llm.engine

    async def main():
        gen = async_llm.generate(
            "Count to one hundred:", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        )
        got = 0
        async for _ in gen:
            got += 1
            if got == 3:
                break
        await gen.aclose()
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        # Later requests still run.
        return await collect(async_llm, "Hello", SamplingParams(temperature=0, max_tokens=3))

    outs = asyncio.run(main())
    assert outs[-1].finished
    assert not engine.has_unfinished_requests()
    engine.drop_cached()  # prefix-cached blocks no request holds: nothing else may be left
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks


def test_bad_requests_raise_in_the_caller(async_llm):
    async def main():
        with pytest.raises(EmptyPromptError):
            await collect(async_llm, "", SamplingParams())
        with pytest.raises(InvalidSamplingParamsError):
            await collect(async_llm, "hi", SamplingParams(max_tokens=0))
        return await collect(async_llm, "hi", SamplingParams(temperature=0, max_tokens=2))

    assert asyncio.run(main())[-1].finished
    assert async_llm.is_running
