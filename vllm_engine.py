"""vllm_engine.py: generation on vLLM, colocated with the trainer, with in-place weight sync.

    from model import load_policy, generate, sync_weights, VLLMEngine   # (re-exported by model.py)
    policy = load_policy("Qwen/Qwen2.5-VL-3B-Instruct", lora_rank=64)
    policy.engine = VLLMEngine(policy, "runs/x/vllm_init")  # model.generate now runs on vLLM
    gens = generate(policy, prompts)
    ... optimizer step ...; sync_weights(policy)             # push the new weights to vLLM

Split out of model.py (one concept per file): model.py holds the policy and HF generation; this
file only what vLLM needs. model.py re-exports every name here lazily, so `from model import
VLLMEngine, sync_weights` works and vLLM itself is imported only when a VLLMEngine is built.
Run through `train_explore.py --engine vllm` / `train_arpo.py --engine vllm` (GPU only).

UNTESTED: vLLM needs CUDA, so this cannot run on a CPU machine. Written against vLLM's documented
LLM API (generate with multi_modal_data; apply_model / collective_rpc to load weights) and kept
small so that it is easy to fix. (The two small helpers below are tested through model.py.)

Where this departs from the papers: nothing algorithmic, this is plumbing. The engine runs in the
trainer's own process, so a weight sync is a tensor copy, not a transfer over a socket; its
log-probs are the raw model's (see VLLMEngine.generate), equal to HF's at temperature 1, top_p 1.
"""
from __future__ import annotations

import os

from PIL import Image

from chat import _image_parts, encode_chats
from model import VISION_TOKENS, Generation, Policy, _special, merged_weights, save_policy


def _collapse_image_pads(ids: list[int], pad: int) -> list[int]:
    # vLLM expands <|image_pad|> itself from the image it is given: hand it one pad per image.
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


class VLLMEngine:
    """Generation on vLLM, colocated with the trainer on the same GPU(s).

        policy.engine = VLLMEngine(policy, checkpoint_dir)   # after load_policy
        gens = generate(policy, prompts)                     # now runs on vLLM
        ... update ...; sync_weights(policy)                  # after every optimizer step
    """

    def __init__(self, policy: Policy, path: str, gpu_memory_utilization: float = 0.35,
                 max_model_len: int = 32768, max_images: int = 15):
        # The engine core in THIS process, so weights pass to it as tensors, not over a socket.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError:
            raise SystemExit("--engine vllm needs vLLM on a CUDA machine (pip install vllm); "
                             "use --engine hf otherwise.") from None
        save_policy(policy, path)  # vLLM loads from disk; a merged LoRA policy loads as a plain model
        self.llm = LLM(model=path, dtype=str(policy.dtype).replace("torch.", ""),
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       limit_mm_per_prompt={"image": max_images}, enable_prefix_caching=True)

    def generate(self, policy, batch_messages, max_new_tokens, temperature, top_p):
        from vllm import SamplingParams
        encs = encode_chats(policy, batch_messages)
        pad = _special(policy, "<|image_pad|>")
        stop = list(policy.model.generation_config.eos_token_id)
        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
            stop_token_ids=stop, skip_special_tokens=True,
            logit_bias={_special(policy, t): -100.0 for t in VISION_TOKENS})
        prompts = []
        for messages, enc in zip(batch_messages, encs):
            # The images resized to exactly what the HF path saw, so vLLM's own resize is a no-op
            # and its prompt equals enc.input_ids (which the trainer will score).
            images = [p["image"].convert("RGB").resize(size, Image.BICUBIC)
                      for p, size in zip(_image_parts(messages), enc.image_sizes)]
            prompt = {"prompt_token_ids": _collapse_image_pads(enc.input_ids, pad)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        gens = []
        for enc, out in zip(encs, outs):
            c = out.outputs[0]
            ids = list(c.token_ids)
            # vLLM's logprobs are the RAW model's (before temperature/top-p) unless the engine is
            # built with logprobs_mode="processed_logprobs"; equal to HF's at temperature 1, top_p 1.
            lps = [lp[t].logprob for t, lp in zip(ids, c.logprobs or [])]
            gens.append(Generation(text=c.text, prompt=enc, completion_ids=ids, logprobs=lps))
        return gens

    def sync_weights(self, policy: Policy) -> None:
        """Copy the trained weights (LoRA merged in) into the engine's model, in place."""
        weights = list(merged_weights(policy))  # (name, tensor) in HF naming; vLLM maps the names
        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(lambda model: model.load_weights(weights))
        else:
            self.llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(weights))
        self.llm.reset_prefix_cache()  # cached KV of old weights would be reused otherwise


def sync_weights(policy: Policy) -> None:
    """After an optimizer step: push the new weights to the generation engine (no-op for HF)."""
    if policy.engine is not None:
        policy.engine.sync_weights(policy)
