"""logprobs and logit_bias through the Pipeline: each sampled token's log-probability equals the
log-softmax of the model's own logits at its position (with the bias added), computed apart."""

from __future__ import annotations

import pytest
import torch

from lm import SamplingParams
from lm.sampling import Sampler
from mm import Pipeline
from mm.default_model import default_model_path


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    return Pipeline.from_pretrained(default_model_path())


def test_logprobs_equal_the_log_softmax_of_the_models_logits(pipeline):
    conversation = [{"role": "user", "content": "Name three colours."}]
    bias = {13: 2.5, 99: -4.0}
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3, logprobs=4, logit_bias=bias)
    out = pipeline.generate([conversation], params, enable_thinking=False)[0]
    assert len(out.logprobs) == out.completion_tokens and [t for t, _, _ in out.logprobs] == out.token_ids
    inputs = pipeline.prepare([conversation], params, False)
    ids = torch.cat([inputs.input_ids, torch.tensor([out.token_ids])], dim=1)
    with torch.no_grad():
        logits = pipeline.model(ids)[0, inputs.input_ids.shape[1] - 1 : -1].float()  # the logits each token came from
    for position, (token, ids_bias) in enumerate(zip(out.token_ids, [bias] * len(out.token_ids))):
        scores = logits[position].clone()
        for t, b in ids_bias.items():
            scores[t] += b
        reference = torch.log_softmax(scores, dim=-1)
        _, logprob, top = out.logprobs[position]
        # (the reference forward's products compute as compute="auto" picks, bf16 where the CPU has
        # AMX tiles; the decode steps in float32: their logits differ by ~1e-3)
        assert abs(logprob - float(reference[token])) < 1e-2
        fourth = float(torch.topk(reference, 4).values[-1])
        assert len(top) == 4 and all(abs(v - float(reference[t])) < 1e-2 and v >= fourth - 1e-2 for t, v in top)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_logprobs_follow_the_penalties_and_greedy_rows_report_them_too():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=2)
    sampler = Sampler([params], [[3, 4]])
    [token] = sampler(logits, [0], [[5]])
    penalised = logits[0].clone()
    for t in (3, 4, 5):
        penalised[t] = penalised[t] / 1.5 if penalised[t] > 0 else penalised[t] * 1.5
    reference = torch.log_softmax(penalised, dim=-1)
    logprob, top = sampler.logprobs[0]
    assert token == int(reference.argmax()) and abs(logprob - float(reference[token])) < 1e-6
    assert [t for t, _ in top] == torch.topk(reference, 2).indices.tolist() and not sampler.plain_greedy


def test_bad_logprobs_and_bias_are_refused():
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logit_bias needs"):
        SamplingParams(logit_bias={3: 101})
    sampler = Sampler([SamplingParams(logit_bias={60: 1.0})], [[]])
    with pytest.raises(ValueError, match="beyond the vocabulary of 50"):
        sampler(torch.randn(1, 50), [0], [[]])
