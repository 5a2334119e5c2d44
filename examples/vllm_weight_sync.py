"""The RL weight-sync bug on vLLM: weights updated in place between rollouts, the prefix cache not reset.

A trainer pushes new weights into the inference engine (here ``llm.apply_model`` scaling one layer's
input norm in place, as ``load_weights`` through ``collective_rpc`` does in RL frameworks) and the
next rollout sends the same prompt: vLLM serves it from prefix-cache blocks computed by the old weights
(NVIDIA-NeMo/RL #4018, prime-rl #1650). Under the doctor that is ``weights/stale-prefix-hit``; with
``--reset`` (``llm.reset_prefix_cache()`` after the update, the fix) the run is clean:

    kvdoctor check -- .venv-vllm/bin/python examples/vllm_weight_sync.py            # exit 1: stale K/V
    kvdoctor check -- .venv-vllm/bin/python examples/vllm_weight_sync.py --reset    # exit 0
"""

from __future__ import annotations

import argparse
import os

# apply_model ships the update function to vLLM's engine core and workers by reference
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def scale_keys(model, factor: float = 1.5) -> str:
    """One optimizer step's worth of change, in place: layer 0's input norm scaled, so every K and V changes
    (on vLLM's CPU backend the linear layers' weights live in packed oneDNN handles, out of reach in place)."""
    for name, p in model.named_parameters():
        if name.endswith("layers.0.input_layernorm.weight"):
            p.data.mul_(factor)
            return name
    raise LookupError("no layers.0.input_layernorm.weight in this model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=2, help="weight updates, each followed by a rollout")
    ap.add_argument("--reset", action="store_true", help="reset the prefix cache after every update (the fix)")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    import vllm_weight_sync as rl  # this file under its module name: workers import the update function from it
    from vllm_offline import QUESTIONS, SYSTEM, _default_model

    llm = LLM(model=args.model or _default_model(), dtype="float32", enforce_eager=True, max_model_len=512,
              block_size=32, num_gpu_blocks_override=48, enable_prefix_caching=True, max_num_seqs=4, seed=0,
              gpu_memory_utilization=0.2)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True) for q in QUESTIONS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate(prompts, params, use_tqdm=False)  # the first rollout fills the prefix cache
    for step in range(args.steps):
        llm.apply_model(rl.scale_keys)
        if args.reset:
            llm.reset_prefix_cache()
        llm.generate(prompts, params, use_tqdm=False)
    print(f"vllm_weight_sync: {args.steps} updates, prefix cache {'reset' if args.reset else 'kept'} after each")


if __name__ == "__main__":
    main()
