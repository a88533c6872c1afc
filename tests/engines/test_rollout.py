"""The rollout engines against the trainer's own arithmetic: real HF `generate` and a real vLLM
engine on the tiny llama, no mocks.

The contract PPO relies on: every response token's log-prob, as the engine reports it, equals
what the trainer recomputes with a full forward pass (log_softmax of the logits over prompt +
response, fp32) to 1e-4, whatever temperature/top-p/top-k chose the tokens; responses end
just after their first EOS (finished) or at max_new_tokens (not finished); n samples per prompt
in input order; seeds reproduce; and vLLM follows the trainer's weights after `load_weights`.

The tiny model is untrained, so responses are arbitrary tokens. To get EOS at varied positions,
some tests point the EOS row of `lm_head` along the model's mean final hidden state
(`eos_prone`), which makes EOS likely in some contexts and not in others.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest
import torch

from hpcrlhf.algos.logprobs import IGNORE, token_logprobs
from hpcrlhf.engines.hf_generate import generate_greedy
from hpcrlhf.engines.rollout import Generation, SamplingParams, build_rollout
from hpcrlhf.engines.rollout.hf import HFRollout
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer

TOL = 1e-4


def engine_tol() -> float:
    """A vLLM engine on a GPU (fp32, its CUDA kernels) against the trainer's CPU forward, measured on
    an H200 (2026-11-26): 4.2e-4 on the tiny llama, 1.46e-3 on the tiny mixtral (fused_moe). Asked of
    vLLM's platform, not `torch.cuda`: CUDA initialised in the test process breaks the engine's
    forked core."""
    from vllm.platforms import current_platform

    return TOL if current_platform.is_cpu() else 2e-3

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model gains nothing from intra-op threads, and two OpenMP threads on two cores
    that something else is also using stall each other (tests ran 100x slower that way)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture
def hf_model(tiny_llama):
    """A fresh fp32 copy of the tiny llama (eval mode): tests may change its weights."""
    return load_causal_lm(tiny_llama, attn_implementation="sdpa")


def hf_rollout(model, tokenizer, **kwargs) -> HFRollout:
    kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
    return HFRollout(model, pad_token_id=tokenizer.pad_token_id, device=CPU, **kwargs)


@torch.no_grad()
def forward_logprobs(model, gen: Generation) -> torch.Tensor:
    """What the trainer recomputes: log p(response token) from one forward over prompt + response."""
    ids = torch.tensor([gen.prompt_ids + gen.response_ids])
    p = len(gen.prompt_ids)
    labels = torch.full_like(ids, IGNORE)
    labels[0, p - 1 : -1] = ids[0, p:]  # labels[t] is the target of logits[t]
    return token_logprobs(model(input_ids=ids).logits, labels)[0, p - 1 : -1]


def max_logprob_error(model, gens: list[list[Generation]]) -> float:
    return max((forward_logprobs(model, g) - torch.tensor(g.logprobs)).abs().max().item() for s in gens for g in s)


def tokens(gens: list[list[Generation]]) -> list[list[list[int]]]:
    return [[g.response_ids for g in s] for s in gens]


def check_structure(gens, prompts, *, n: int, max_new_tokens: int, eos: int) -> None:
    """n samples per prompt in input order; finished <=> ends with its only EOS; else full length."""
    assert len(gens) == len(prompts)
    for prompt, samples in zip(prompts, gens):
        assert len(samples) == n
        for g in samples:
            assert g.prompt_ids == list(prompt)
            assert 1 <= len(g.response_ids) <= max_new_tokens
            assert len(g.logprobs) == len(g.response_ids)
            assert all(isinstance(x, float) and x <= 0 for x in g.logprobs)
            if g.finished:
                assert g.response_ids[-1] == eos and eos not in g.response_ids[:-1]
            else:
                assert eos not in g.response_ids and len(g.response_ids) == max_new_tokens


@torch.no_grad()
def eos_prone(model, prompts, eos: int, alpha: float) -> dict[str, torch.Tensor]:
    """The model's state dict with lm_head's EOS row set to alpha x the mean final hidden state."""
    hidden = torch.cat([model.model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"][eos] = alpha * hidden.mean(0)
    return state


def perturbed(state, std: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + std * torch.randn(v.shape, generator=g) for k, v in state.items()}


# --- the interface ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1)])
def test_sampling_params_are_checked(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_a_generation_pickled_before_the_rollout_package_split_loads(tmp_path):
    """Checkpoints hold the rollout generated ahead (`ahead_rank*.pt`): `Generation`s pickled by class
    path. One written while the class was `hpcrlhf.engines.rollout.Generation` (a module then, now a
    package whose contract lives in `.contract`) loads as the class of today."""
    g = Generation(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.5, -0.25], finished=True)
    saved = pickle.dumps({"step": 3, "generations": [[g]]}, protocol=2)  # torch.save's protocol
    old = saved.replace(f"{Generation.__module__}\nGeneration\n".encode(), b"hpcrlhf.engines.rollout\nGeneration\n")
    assert b"hpcrlhf.engines.rollout\nGeneration\n" in old
    (tmp_path / "ahead_rank0.pt").write_bytes(old)
    loaded = pickle.loads((tmp_path / "ahead_rank0.pt").read_bytes())
    assert loaded == {"step": 3, "generations": [[g]]} and type(loaded["generations"][0][0]) is Generation


def test_build_rollout_names_the_valid_backends(hf_model, tokenizer):
    with pytest.raises(ValueError, match="'hf', 'vllm'"):
        build_rollout("sglang")
    engine = build_rollout("hf", model=hf_model, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id, device=CPU)
    assert isinstance(engine, HFRollout)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5, 6], []], SamplingParams())


# --- Hugging Face generate -------------------------------------------------------------------


def test_hf_sampled_logprobs_are_raw_and_match_the_trainers_forward(hf_model, tokenizer, rollout_prompts):
    # A longer prompt too, so rows of a batch are left-padded by different amounts.
    prompts = rollout_prompts + [rollout_prompts[0] + rollout_prompts[1]]
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, seed=0)
    gens = hf_rollout(hf_model, tokenizer, batch_size=12).generate(prompts, params)  # 4 prompts x 3 per batch
    check_structure(gens, prompts, n=3, max_new_tokens=12, eos=tokenizer.eos_token_id)
    # Tokens were drawn at T=0.7 from the top 20, but the log-probs are the raw distribution's
    # (a tempered/truncated one would be off by far more than 1e-4).
    assert max_logprob_error(hf_model, gens) < TOL
    assert all(len({tuple(g.response_ids) for g in s}) > 1 for s in gens)


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_hf_response_is_cut_just_after_its_first_eos(hf_model, tokenizer, rollout_prompts, pad_is_eos):
    """Greedy with a stand-in EOS: a token the plain greedy responses contain mid-way in some
    prompts and not at all in others. Each response must be its plain greedy response cut just
    after the first stand-in (finished), or whole (not finished)."""
    params = SamplingParams(greedy=True, max_new_tokens=12)
    plain = [s[0] for s in hf_rollout(hf_model, tokenizer).generate(rollout_prompts, params)]
    responses = [g.response_ids for g in plain]

    def informative(t: int) -> bool:
        having = [r for r in responses if t in r]
        return len(having) >= 2 and len(having) < len(responses) and any(r.index(t) > 0 for r in having)

    stand_in = next(t for t in sorted({t for r in responses for t in r}) if informative(t))
    pad = stand_in if pad_is_eos else tokenizer.pad_token_id
    engine = HFRollout(hf_model, pad_token_id=pad, eos_token_id=stand_in, device=CPU, batch_size=8)
    gens = engine.generate(rollout_prompts, params)
    check_structure(gens, rollout_prompts, n=1, max_new_tokens=12, eos=stand_in)
    for full, (g,) in zip(plain, gens):
        if stand_in in full.response_ids:
            end = full.response_ids.index(stand_in) + 1
            assert g.finished and g.response_ids == full.response_ids[:end]
        else:
            assert not g.finished and g.response_ids == full.response_ids
        assert g.logprobs == pytest.approx(full.logprobs[: len(g.logprobs)], abs=TOL)
    assert {g.finished for (g,) in gens} == {True, False}


def test_hf_sampled_eos_at_varied_steps(hf_model, tokenizer, rollout_prompts):
    eos = tokenizer.eos_token_id
    hf_model.load_state_dict(eos_prone(hf_model, rollout_prompts, eos, alpha=0.1))
    gens = hf_rollout(hf_model, tokenizer).generate(rollout_prompts, SamplingParams(n=4, max_new_tokens=12, seed=1))
    check_structure(gens, rollout_prompts, n=4, max_new_tokens=12, eos=eos)
    flat = [g for s in gens for g in s]
    assert len({len(g.response_ids) for g in flat if g.finished}) >= 3  # rows of one batch end at different steps
    assert any(not g.finished for g in flat)
    assert max_logprob_error(hf_model, gens) < TOL  # EOS's own log-prob included


def test_min_new_tokens_gives_fixed_lengths_on_both_backends(hf_model, vllm_rollout, tokenizer, rollout_prompts):
    """With EOS likely at every step, min_new_tokens = max_new_tokens still makes every response
    exactly that long (what benchmarks rely on); without it responses end early."""
    eos = tokenizer.eos_token_id
    base = {k: v.clone() for k, v in hf_model.state_dict().items()}
    hf_model.load_state_dict(eos_prone(hf_model, rollout_prompts, eos, alpha=0.1))
    early = hf_rollout(hf_model, tokenizer).generate(rollout_prompts, SamplingParams(n=4, max_new_tokens=12, seed=1))
    assert any(g.finished for s in early for g in s)
    fixed = SamplingParams(n=4, max_new_tokens=12, min_new_tokens=12, seed=1)
    try:
        vllm_rollout.load_weights(hf_model.state_dict())
        for gens in (hf_rollout(hf_model, tokenizer).generate(rollout_prompts, fixed),
                     vllm_rollout.generate(rollout_prompts, fixed)):
            assert all(len(g.response_ids) == 12 and eos not in g.response_ids[:-1] for s in gens for g in s)
            assert max_logprob_error(hf_model, gens) < TOL
    finally:
        vllm_rollout.load_weights(base)  # the engine is shared by the module's tests
    with pytest.raises(ValueError, match="min_new_tokens must be in"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


def test_vllm_streams_each_group_in_the_step_it_finishes(hf_model, vllm_rollout, tokenizer, rollout_prompts):
    """With responses ending at varied steps, a prompt's group comes back once its longest sample ends
    (the batch fits one step: every sequence started together), each prompt once, the
    generations equal to the whole batch's; a stream given up half-way leaves nothing queued."""
    eos = tokenizer.eos_token_id
    base = {k: v.clone() for k, v in hf_model.state_dict().items()}
    params = SamplingParams(n=2, max_new_tokens=12, seed=1, first_index=5)
    try:
        vllm_rollout.load_weights(eos_prone(hf_model, rollout_prompts, eos, alpha=0.1))
        items = list(vllm_rollout.stream(rollout_prompts, params))
        whole = vllm_rollout.generate(rollout_prompts, params)
        assert sorted(i for item in items for i, _ in item) == list(range(len(rollout_prompts)))
        assert tokens([gens for _, gens in sorted(g for item in items for g in item)]) == tokens(whole)
        longest = [sorted({max(len(g.response_ids) for g in gens) for _, gens in item}) for item in items]
        assert len(items) >= 3 and all(a[-1] <= b[0] for a, b in zip(longest, longest[1:])), longest
        stream = vllm_rollout.stream(rollout_prompts, params)
        next(stream)
        stream.close()  # the rest of the batch aborted: the engine takes the next batch alone
        assert not vllm_rollout.llm.llm_engine.has_unfinished_requests()
        assert tokens(vllm_rollout.generate(rollout_prompts, params)) == tokens(whole)
    finally:
        vllm_rollout.load_weights(base)  # the engine is shared by the module's tests


def test_hf_seed_reproduces_and_leaves_the_global_rng_alone(hf_model, tokenizer, rollout_prompts):
    engine = hf_rollout(hf_model, tokenizer)
    params = SamplingParams(n=2, max_new_tokens=10, seed=7)
    rng = torch.get_rng_state()
    first = engine.generate(rollout_prompts, params)
    assert torch.equal(torch.get_rng_state(), rng)
    assert engine.generate(rollout_prompts, params) == first
    assert tokens(engine.generate(rollout_prompts, replace(params, seed=8))) != tokens(first)


def test_hf_generates_in_eval_mode_and_restores_the_mode(hf_model, tokenizer, rollout_prompts):
    modes: list[bool] = []
    hf_model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    engine = hf_rollout(hf_model, tokenizer)
    for training in (True, False):
        hf_model.train(training)
        modes.clear()
        engine.generate(rollout_prompts[:2], SamplingParams(max_new_tokens=3, seed=0))
        assert modes and not any(modes)
        assert hf_model.training is training


def test_a_stop_request_ends_a_generation_at_the_next_decode_step(hf_model, tokenizer, rollout_prompts):
    """A time-limit signal must not wait for a long generation (issue 36): once this process is asked
    to stop, HF generate ends at the next decode step, sampled and greedy alike."""
    from hpcrlhf.run.signals import STOP_SIGNALS, StopFlag

    fixed = SamplingParams(n=2, max_new_tokens=40, min_new_tokens=40, seed=1)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        flag = StopFlag().install()
        one_token = generate_greedy(hf_model, tokenizer, rollout_prompts[:4], max_new_tokens=1, device=CPU)
        assert {len(g.response_ids) for s in hf_rollout(hf_model, tokenizer).generate(rollout_prompts[:2], fixed)
                for g in s} == {40}
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.requested
        cut = hf_rollout(hf_model, tokenizer, batch_size=2).generate(rollout_prompts[:4], fixed)
        greedy = generate_greedy(hf_model, tokenizer, rollout_prompts[:4], max_new_tokens=40, device=CPU)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert [len(g.response_ids) for s in cut for g in s] == [1] * 8  # every batch: one token, then done
    assert greedy == one_token


def test_hf_greedy_equals_generate_greedy(hf_model, tokenizer, rollout_prompts):
    params = SamplingParams(greedy=True, n=2, max_new_tokens=12)
    gens = hf_rollout(hf_model, tokenizer, batch_size=5).generate(rollout_prompts, params)
    expected = generate_greedy(hf_model, tokenizer, rollout_prompts, max_new_tokens=12, device=CPU)
    assert [tokenizer.decode(s[0].response_ids, skip_special_tokens=True) for s in gens] == expected
    assert all(a == b and a is not b for a, b in gens)  # n copies of the one greedy response
    # Batching does not change greedy responses (nor their order).
    assert tokens(hf_rollout(hf_model, tokenizer).generate(rollout_prompts, params)) == tokens(gens)
    assert max_logprob_error(hf_model, gens) < TOL


# --- vLLM ------------------------------------------------------------------------------------


GLOO_SCRIPT = textwrap.dedent("""
    import json, os, sys

    import torch
    import torch.distributed as dist

    from hpcrlhf.engines.rollout import SamplingParams
    from hpcrlhf.engines.rollout.vllm import VLLMRollout

    WATCHED = ("LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD", "TORCHINDUCTOR_COMPILE_THREADS")

    def agent_store_flag(worker):  # runs in the engine's worker process
        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE")

    def all_reduce_ok() -> bool:
        t = torch.ones(3)
        dist.all_reduce(t)
        return t.tolist() == [1.0, 1.0, 1.0]

    if __name__ == "__main__":
        dist.init_process_group(backend="gloo", init_method="env://")  # torchrun's rendezvous, as `hpcrlhf train`'s
        threads, env = torch.get_num_threads(), {k: os.environ.get(k) for k in WATCHED}
        engine = VLLMRollout(sys.argv[1], max_model_len=64, kv_cache_bytes=1 << 26)
        gen = engine.generate([[23, 22, 17, 31, 23, 35]], SamplingParams(greedy=True, max_new_tokens=8))
        report = dict(response=gen[0][0].response_ids, group_ok=all_reduce_ok(),
                      threads_kept=torch.get_num_threads() == threads,
                      env_kept={k: os.environ.get(k) for k in WATCHED} == env,
                      set_num_threads_untouched=type(torch.set_num_threads).__name__ == "builtin_function_or_method",
                      agent_store=[os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
                                   *engine._llm.collective_rpc(agent_store_flag)],
                      eager=engine._llm.llm_engine.vllm_config.model_config.enforce_eager)  # by default on CPU
        engine.load_weights({k: v for k, v in torch.load(sys.argv[2], weights_only=True).items()})
        engine.close()
        report["group_ok_after_close"] = dist.is_initialized() and all_reduce_ok()
        dist.destroy_process_group()
        print("REPORT " + json.dumps(report))
""")


# First among the vLLM tests, so the module's shared engine is not yet running beside it.
@pytest.mark.distributed
def test_vllm_inside_a_gloo_process_group(tiny_llama, hf_model, tokenizer, tmp_path):
    """A trainer process under torchrun already has its default (gloo) group: vLLM must neither
    collide with it nor destroy it, and must leave the trainer's threads and environment alone.
    torchrun's TORCHELASTIC_USE_AGENT_STORE, inherited by vLLM's processes, made the engine's
    own rendezvous wait forever for a store server (seen on an H100 in `hpcrlhf bench`)."""
    pytest.importorskip("vllm")
    script = tmp_path / "gloo_vllm.py"
    script.write_text(GLOO_SCRIPT)
    state = tmp_path / "state.pt"
    torch.save(hf_model.state_dict(), state)
    # VLLM_ALLOW_INSECURE_SERIALIZATION: collective_rpc takes the script's own function
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=1", str(script), tiny_llama, str(state)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(lines[-1].removeprefix("REPORT "))
    expected = hf_rollout(hf_model, tokenizer).generate([[23, 22, 17, 31, 23, 35]],
                                                         SamplingParams(greedy=True, max_new_tokens=8))
    assert report.pop("response") == expected[0][0].response_ids
    assert report == dict(group_ok=True, threads_kept=True, env_kept=True, set_num_threads_untouched=True,
                          group_ok_after_close=True, agent_store=["True", None],  # the trainer's, the engine's
                          eager=True)


def test_vllm_sampled_logprobs_are_raw_and_match_the_trainers_forward(vllm_rollout, hf_model, tokenizer,
                                                                     rollout_prompts):
    prompts = rollout_prompts + [rollout_prompts[0] + rollout_prompts[1]]
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, seed=0)
    gens = vllm_rollout.generate(prompts, params)
    check_structure(gens, prompts, n=3, max_new_tokens=12, eos=tokenizer.eos_token_id)
    assert max_logprob_error(hf_model, gens) < TOL
    assert all(len({tuple(g.response_ids) for g in s}) > 1 for s in gens)


def test_vllm_greedy_equals_hf_greedy(vllm_rollout, hf_model, tokenizer, rollout_prompts):
    params = SamplingParams(greedy=True, n=2, max_new_tokens=16)
    gens = vllm_rollout.generate(rollout_prompts, params)
    hf = hf_rollout(hf_model, tokenizer).generate(rollout_prompts, params)
    assert tokens(gens) == tokens(hf)
    assert [[g.finished for g in s] for s in gens] == [[g.finished for g in s] for s in hf]
    assert all(a == b and a is not b for a, b in gens)
    assert max_logprob_error(hf_model, gens) < TOL


def test_vllm_seed_reproduces_and_differs_per_prompt(vllm_rollout, rollout_prompts):
    params = SamplingParams(n=2, max_new_tokens=10, seed=11)
    first = vllm_rollout.generate(rollout_prompts, params)
    assert tokens(vllm_rollout.generate(rollout_prompts, params)) == tokens(first)
    assert tokens(vllm_rollout.generate(rollout_prompts, replace(params, seed=12))) != tokens(first)
    # One seed per call, yet the same prompt twice in a call gets independent samples.
    twice = vllm_rollout.generate([rollout_prompts[0]] * 2, params)
    assert tokens(twice)[0] != tokens(twice)[1]


def test_vllm_batch_split_with_first_index_samples_as_the_whole_batch(vllm_rollout, rollout_prompts):
    """What lets several engines share a rollout: each part, told where it starts, draws the
    samples one engine would have drawn for those prompts in the whole batch."""
    params = SamplingParams(n=2, max_new_tokens=10, seed=5)
    whole = tokens(vllm_rollout.generate(rollout_prompts, params))
    cut = len(rollout_prompts) // 2
    parts = (tokens(vllm_rollout.generate(rollout_prompts[:cut], params))
             + tokens(vllm_rollout.generate(rollout_prompts[cut:], replace(params, first_index=cut))))
    assert parts == whole
    assert tokens(vllm_rollout.generate(rollout_prompts[cut:], params)) != whole[cut:]  # the index matters


def test_vllm_follows_load_weights(vllm_rollout, hf_model, tokenizer, rollout_prompts):
    eos = tokenizer.eos_token_id
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    # A prompt longer than vLLM's KV block (128 tokens on CPU) leaves a block in the prefix
    # cache: after the update it must not be reused (it holds keys/values of the old weights).
    prompts = rollout_prompts + [(sum(rollout_prompts, []) * 2)[:140]]
    base = {k: v.clone() for k, v in hf_model.state_dict().items()}
    before = vllm_rollout.generate(prompts, greedy)
    # New weights: everything moved by noise, and EOS made likely in some contexts.
    hf_model.load_state_dict(perturbed(base, std=0.02, seed=1))
    new = eos_prone(hf_model, rollout_prompts, eos, alpha=0.02)
    hf_model.load_state_dict(new)
    try:
        vllm_rollout.load_weights(new)
        after = vllm_rollout.generate(prompts, greedy)
        assert sum(a != b for a, b in zip(tokens(before), tokens(after))) >= len(prompts) // 2
        expected = hf_rollout(hf_model, tokenizer).generate(prompts, greedy)
        assert tokens(after) == tokens(expected)
        assert [s[0].finished for s in after] == [s[0].finished for s in expected]
        assert {s[0].finished for s in after} == {True, False}
        check_structure(after, prompts, n=1, max_new_tokens=12, eos=eos)
        assert max_logprob_error(hf_model, after) < TOL
        sampled = vllm_rollout.generate(prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=2))
        check_structure(sampled, prompts, n=2, max_new_tokens=12, eos=eos)
        assert max_logprob_error(hf_model, sampled) < TOL
    finally:
        vllm_rollout.load_weights(base)  # the engine is shared by the module's tests
    assert tokens(vllm_rollout.generate(prompts, greedy)) == tokens(before)


def test_vllm_seeded_batch_larger_than_the_token_budget(vllm_rollout, hf_model, tokenizer):
    """Ordinary RL sizes: 32 prompts of 64-96 tokens x 8 samples = 256 sequences, ~2.5x the CPU
    engine's per-step token budget (4096). With chunked prefill (vLLM's default) the prompt that
    straddles the budget is split, and vLLM's rewind of its seeded generator killed the CPU
    engine. Samples must also not depend on how the engine batched them: the same prompts in
    small calls (each within the budget) draw the same tokens."""
    g = torch.Generator().manual_seed(3)
    vocab = tokenizer.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(64, 97, (32,), generator=g)]
    assert sum(map(len, prompts)) * 8 > 4096
    params = SamplingParams(n=8, max_new_tokens=12, seed=7)
    gens = vllm_rollout.generate(prompts, params)
    check_structure(gens, prompts, n=8, max_new_tokens=12, eos=tokenizer.eos_token_id)
    assert max_logprob_error(hf_model, gens[:4]) < engine_tol()
    small = [s for i in range(0, len(prompts), 4)
             for s in vllm_rollout.generate(prompts[i : i + 4], replace(params, first_index=i))]
    assert tokens(small) == tokens(gens)


@pytest.mark.parametrize("on_cpu, kwargs, expected", [
    (True, {}, {"enable_chunked_prefill": False}),
    (False, {}, {"enable_chunked_prefill": True}),
    (False, {"chunked_prefill": False, "max_num_batched_tokens": 300}, {"enable_chunked_prefill": False,
                                                                         "max_num_batched_tokens": 300}),
    (True, {"max_num_seqs": 64, "max_num_batched_tokens": 2048}, {"enable_chunked_prefill": False, "max_num_seqs": 64,
                                                                   "max_num_batched_tokens": 2048}),
])
def test_vllm_batching_arguments(on_cpu, kwargs, expected):
    from hpcrlhf.engines.rollout.vllm import vllm_batching

    assert vllm_batching(on_cpu=on_cpu, max_model_len=256, **kwargs) == expected


@pytest.mark.parametrize("on_cpu, kwargs, field", [
    (True, {"chunked_prefill": True}, "rollout.vllm_chunked_prefill"),
    (False, {"chunked_prefill": False, "max_num_batched_tokens": 255}, "rollout.vllm_max_num_batched_tokens"),
])
def test_vllm_batching_refuses_what_cannot_work(on_cpu, kwargs, field):
    from hpcrlhf.engines.rollout.vllm import vllm_batching
    from hpcrlhf.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        vllm_batching(on_cpu=on_cpu, max_model_len=256, **kwargs)


def test_an_engine_shutdown_vllm_gives_up_on_still_ends_every_engine_process():
    """vLLM 0.32 force-kills a slow engine core's process tree naming each child first; a child that
    exits meanwhile raises NoSuchProcess out of its walk, the rest left running. `shut_down`
    (`VLLMRollout.close`) kills what is left: here a real process tree stands for the engine core
    and its workers, and the shutdown fails as vLLM's did."""
    from types import SimpleNamespace

    import psutil

    from hpcrlhf.engines.rollout.vllm import shut_down

    core = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"])
    try:
        tree = psutil.Process(core.pid)
        while len(tree.children()) < 2:  # both workers started
            time.sleep(0.01)
        everyone = [tree, *tree.children(recursive=True)]

        def gives_up():
            raise psutil.NoSuchProcess(12345, "VLLM::Worker_TP1")

        engine_core = SimpleNamespace(shutdown=gives_up,
                                      resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[core])))
        shut_down(engine_core)
        gone, alive = psutil.wait_procs(everyone, timeout=10)
        assert not alive, alive
    finally:
        core.kill()


# --- agents: one model turn at a time (the request-level engines the agent scheduler drives) -----


def agent_episodes(tokenizer, pool, n: int) -> list:
    from hpcrlhf.agents.environments import load_environment
    from hpcrlhf.agents.episode import Episode, EpisodeLimits, Setup
    from hpcrlhf.agents.parsers import hermes
    from hpcrlhf.agents.render import ChatRenderer

    environment = load_environment("tests.agents.envs:Countdown", {"turns": 3})
    setup = Setup(environment, (), ChatRenderer(tokenizer), hermes, tokenizer, EpisodeLimits(max_tokens=96), pool)
    return [Episode(str(i), {"id": f"r{i}"}, 10 + i, setup) for i in range(n)]


def agent_eos_prone(model, tokenizer, alpha: float = 0.1) -> dict[str, torch.Tensor]:
    """The model's weights made to end turns early in the Countdown conversations (several turns fit; alpha
    0.1: mostly at once)."""
    from hpcrlhf.agents.render import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    prompts = [renderer.prompt([{"role": "system", "content": "Count."}, {"role": "user", "content": f"start {i}"}])
               + renderer.observation([{"role": "user", "content": "again"}]) for i in range(10)]
    return eos_prone(model, prompts, tokenizer.eos_token_id, alpha=alpha)


def check_transcripts(model, episodes, tol: float) -> None:
    """At the model's tokens the engine's log-probs are the trainer's forward pass over the whole
    transcript (the environment's tokens in it as context); elsewhere they are 0."""
    for ep in episodes:
        got = torch.tensor(ep.logprobs)
        want = forward_logprobs(model, Generation(ep.prompt_ids, ep.ids, ep.logprobs, True))
        action = torch.tensor(ep.action)
        assert (want - got)[action].abs().max() < tol and (got[~action] == 0).all()


def run_agents(engine, tokenizer, n: int = 6, schedule: str = "trajectory") -> list:
    from hpcrlhf.agents.pool import EnvPool
    from hpcrlhf.agents.scheduler import run_episodes

    pool = EnvPool(4)
    try:
        episodes = agent_episodes(tokenizer, pool, n)
        run_episodes(engine, episodes, pool, max_new_tokens=10, seed=3, schedule=schedule)
    finally:
        pool.close()
    assert sum(ep.record.turns for ep in episodes) > n  # some trajectories took several turns
    return episodes


def test_hf_agent_turns_are_reproducible_and_carry_the_trainers_logprobs(hf_model, tokenizer):
    from hpcrlhf.agents.requests import HFRequests

    hf_model.load_state_dict(agent_eos_prone(hf_model, tokenizer))
    params = SamplingParams(max_new_tokens=10)
    runs = [run_agents(HFRequests(hf_rollout(hf_model, tokenizer), params), tokenizer, schedule="turn") for _ in range(2)]
    assert [ep.ids for ep in runs[0]] == [ep.ids for ep in runs[1]]
    check_transcripts(hf_model, runs[0], TOL)


@pytest.mark.slow
def test_agent_turns_on_an_engine_loop_are_a_plain_engines_beside_other_batches(vllm_rollout, hf_model, tokenizer,
                                                                                streaming, rollout_prompts):
    """Trajectories on an engine loop (`EngineLoop.turns`: each turn posted by the agent scheduler's thread and
    generated between the loop's other samples) -- two agent batches at once, beside a plain batch -- take the
    turns a plain engine gives them, token for token, with the trainer's log-probs, each trajectory of the one
    version the loop held."""
    from concurrent.futures import ThreadPoolExecutor

    from hpcrlhf.agents.requests import VLLMRequests

    base = {k: v.clone() for k, v in hf_model.state_dict().items()}
    hf_model.load_state_dict(agent_eos_prone(hf_model, tokenizer))
    params = SamplingParams(max_new_tokens=10)
    try:
        vllm_rollout.load_weights(hf_model.state_dict())
        plain = run_agents(VLLMRequests.on_engine(vllm_rollout, params), tokenizer)
        streaming.load_weights(hf_model.state_dict(), version=1)
        other = streaming.launch(rollout_prompts[:4], SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=5))
        with ThreadPoolExecutor(2) as threads:
            runs = list(threads.map(lambda _: run_agents(VLLMRequests.on_loop(streaming.loop, params), tokenizer),
                                    range(2)))
        assert [len(gens) for gens in other.result()] == [2] * 4
        for run in runs:
            assert [ep.ids for ep in run] == [ep.ids for ep in plain]
            assert all(ep.generation().versions == [(0, 1)] for ep in run)
        assert all(ep.generation().versions is None for ep in plain)  # (a plain engine's: the launch version)
        check_transcripts(hf_model, runs[0], engine_tol())
        assert streaming.loop.post(lambda: streaming.engine.llm.llm_engine.has_unfinished_requests()).result() is False
    finally:
        vllm_rollout.load_weights(base)  # the engine is shared by the module's tests


@pytest.mark.slow
def test_agent_turns_paused_by_a_weight_update_go_on_under_it_and_each_trajectory_records_its_spans(
        streaming, hf_model, tokenizer):
    """rollout.partial with agents: new weights taken while turns are under way pause them and they go on under
    the new ones; turns begun after are of the new version. Each trajectory's `Generation.versions` splits its
    response where the version changed -- inside a turn or between turns -- and every model token's log-prob
    is that of its span's weights (the HF model's forward over the whole transcript)."""
    from concurrent.futures import ThreadPoolExecutor

    from hpcrlhf.agents.requests import VLLMRequests
    from hpcrlhf.engines.rollout.contract import token_versions
    from tests.engines.test_loop import Hold, load_behind

    old_state = agent_eos_prone(hf_model, tokenizer, alpha=0.07)  # turns of 1-10 tokens, most trajectories 3 turns
    new_state = perturbed(old_state, 0.02, seed=7)
    streaming.load_weights(old_state, version=5)
    stream = streaming.loop.stream
    gate = Hold(streaming.loop, lambda: any(len(s.tokens) >= 2 and not s.finished for s in stream.samples.values()))
    with ThreadPoolExecutor(1) as caller:
        running = caller.submit(run_agents, VLLMRequests.on_loop(streaming.loop, SamplingParams(max_new_tokens=10)),
                                tokenizer, 8)
        gate.reached(running.done)
        load_behind(streaming, gate, new_state, 6)
        episodes = running.result(timeout=300)
    models = {5: hf_model, 6: load_causal_lm_like(hf_model, new_state)}
    hf_model.load_state_dict(old_state)
    spans = [ep.generation().versions for ep in episodes]
    # a trajectory whose first turn began after the update (its environment reset later: the pool has 4 workers for
    # 8) is all of version 6; none goes back to an older version
    assert all(v[0][0] == 0 and [version for _, version in v] in ([5], [5, 6], [6]) for v in spans), spans
    assert any(len(v) == 2 and v[1][1] == 6 for v in spans), spans  # some crossed the update
    inside = [ep for ep, v in zip(episodes, spans) if len(v) == 2 and ep.action[v[1][0] - 1] and ep.action[v[1][0]]]
    assert inside, spans  # a turn paused mid-way (the token before the split is the same turn's)
    for ep in episodes:
        g = ep.generation()
        per_token = token_versions(g)
        with torch.no_grad():
            want = {v: forward_logprobs(m, Generation(ep.prompt_ids, ep.ids, ep.logprobs, True))
                    for v, m in models.items()}
        expected = torch.tensor([float(want[v][p]) for p, v in enumerate(per_token)])
        action = torch.tensor(ep.action)
        assert (expected - torch.tensor(ep.logprobs))[action].abs().max() < engine_tol(), g.versions


def load_causal_lm_like(model, state: dict[str, torch.Tensor]):
    """A copy of `model` holding `state`."""
    import copy

    other = copy.deepcopy(model)
    other.load_state_dict(state)
    return other.eval()


def test_vllm_agent_turns_carry_the_trainers_logprobs_whatever_the_schedule(vllm_rollout, hf_model, tokenizer):
    from hpcrlhf.agents.requests import VLLMRequests

    base = {k: v.clone() for k, v in hf_model.state_dict().items()}
    hf_model.load_state_dict(agent_eos_prone(hf_model, tokenizer))
    params = SamplingParams(max_new_tokens=10)
    try:
        vllm_rollout.load_weights(hf_model.state_dict())
        runs = {s: run_agents(VLLMRequests.on_engine(vllm_rollout, params), tokenizer, schedule=s) for s in ("trajectory", "turn")}
        # each turn seeded by its trajectory and number: the same tokens however the turns were batched
        assert [ep.ids for ep in runs["trajectory"]] == [ep.ids for ep in runs["turn"]]
        check_transcripts(hf_model, runs["trajectory"], engine_tol())
        assert not vllm_rollout.llm.llm_engine.has_unfinished_requests()
    finally:
        vllm_rollout.load_weights(base)  # the engine is shared by the module's tests
