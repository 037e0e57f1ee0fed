"""vllm_engine.py: generation on vLLM, colocated with the trainer, with in-place weight sync.

    from model import load_policy, generate, sync_weights; from vllm_engine import VLLMEngine
    policy = load_policy("Qwen/Qwen2.5-VL-3B-Instruct", lora_rank=64)
    policy.engine = VLLMEngine(policy, "runs/x/vllm_init")  # model.generate now runs on vLLM
    gens = generate(policy, prompts)
    ... optimizer step ...; sync_weights(policy)             # push the new weights to vLLM

One concept per file: model.py holds the policy and HF generation (its generate and sync_weights
hand over to policy.engine when one is set); this file holds only what vLLM needs, on top of
model.py and chat.py. The trainers import it only with `--engine vllm`, and vLLM itself is
imported only when a VLLMEngine is built. Run through `train_explore.py --engine vllm` /
`train_arpo.py --engine vllm` (GPU only).

UNTESTED: vLLM needs CUDA, so this cannot run on a CPU machine. Written against vLLM's documented
LLM API (generate with multi_modal_data; apply_model / collective_rpc to load weights) and kept
small so that it is easy to fix. The small helpers below are tested on CPU in tests/test_model.py
(collapse_image_pads, needed_model_len).

Where this departs from the papers: nothing algorithmic, this is plumbing. The engine runs in the
trainer's own process, so a weight sync is a tensor copy, not a transfer over a socket. Its
log-probs mean what HF generate's mean (model.Generation.logprobs): the sampling distribution,
after temperature, top-p and the vision-token ban (vLLM's logprobs_mode="processed_logprobs";
the default "raw_logprobs" would be the model's before temperature). Its context length is
derived from the run's flags (needed_model_len); ARPO's release leaves vLLM at the model's own.
"""
from __future__ import annotations

import math
import os

from PIL import Image

from chat import VISION_TOKENS, encode_chats, image_parts, special_id
from model import Generation, Policy, merged_weights, save_policy


def needed_model_len(max_images: int, max_pixels: int, answer_tokens: int, prompt_tokens: int = 2048,
                  limit: int | None = None) -> int:
    """The longest prompt + answer a run can send vLLM, in tokens, from its flags.

    A screenshot costs at most max_pixels / (28 * 28) tokens (one per 28x28 px after the 2x2
    merge; smart_resize keeps h * w <= max_pixels) plus its <|vision_start|>, <|vision_end|> and
    the turn's 5 ChatML tokens; answer_tokens is every answer the context can hold (ARPO: all
    max_steps answers of max_new_tokens, plus 6 ChatML tokens per turn); prompt_tokens covers the
    system prompt, the instruction and the rest. ARPO's setting (15 screenshots of 1920x1080 at
    max_pixels 2,116,800: 2,691 tokens each, at most 2,700; 15 answers of 256 tokens) comes to
    47,104, well above a fixed 32,768. Rounded up to a multiple of 1024. Over `limit` (the
    model's position embeddings), ValueError in one sentence.
    """
    per_image = max_pixels // (28 * 28) + 2 + 5
    need = max_images * per_image + answer_tokens + prompt_tokens
    need = math.ceil(need / 1024) * 1024
    if limit is not None and need > limit:
        raise ValueError(f"{max_images} screenshots of up to {max_pixels} pixels need {need} tokens of context, "
                         f"more than this model's {limit}; lower --max-images or --max-pixels.")
    return need


def collapse_image_pads(ids: list[int], pad: int) -> list[int]:
    """Each run of <|image_pad|> collapsed to one pad, as the chat template writes it: vLLM expands
    the pad itself from the image it is given."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


class VLLMEngine:
    """Generation on vLLM, colocated with the trainer on the same GPU(s).

        policy.engine = VLLMEngine(policy, checkpoint_dir)   # after load_policy
        gens = generate(policy, prompts)                     # now runs on vLLM
        ... update ...; sync_weights(policy)                  # after every optimizer step
    """

    def __init__(self, policy: Policy, path: str, gpu_memory_utilization: float = 0.35,
                 max_model_len: int | None = None, max_images: int = 15, answer_tokens: int = 4096):
        # max_model_len None: derived from max_images, the policy's max_pixels and answer_tokens
        # (the answers a prompt can hold), so the longest prompt a run sends always fits.
        if max_model_len is None:
            ip = policy.image_processor  # transformers 5 keeps max_pixels as size.longest_edge; 4.x as an attribute
            max_pixels = getattr(ip, "max_pixels", None) or getattr(ip.size, "longest_edge", None) or ip.size["longest_edge"]
            max_model_len = needed_model_len(max_images, int(max_pixels), answer_tokens)
        # The engine core in THIS process, so weights pass to it as tensors, not over a socket.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError:
            raise SystemExit("--engine vllm needs vLLM on a CUDA machine (pip install vllm); "
                             "use --engine hf otherwise.") from None
        save_policy(policy, path)  # vLLM loads from disk; a merged LoRA policy loads as a plain model
        try:
            # processed_logprobs: log-probs of the distribution sampled from (temperature, top-p,
            # logit bias applied), the meaning Generation.logprobs has on the HF path too.
            self.llm = LLM(model=path, dtype=str(policy.dtype).replace("torch.", ""),
                           gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                           limit_mm_per_prompt={"image": max_images}, enable_prefix_caching=True,
                           logprobs_mode="processed_logprobs")
        except TypeError as e:
            if "logprobs_mode" not in str(e):
                raise
            raise SystemExit("--engine vllm needs a vLLM with logprobs_mode='processed_logprobs' "
                             "(pip install -U vllm), or use --engine hf.") from None

    def generate(self, policy, batch_messages, max_new_tokens, temperature, top_p):
        from vllm import SamplingParams
        encs = encode_chats(policy, batch_messages)
        pad = special_id(policy.tokenizer, "<|image_pad|>")
        stop = list(policy.model.generation_config.eos_token_id)
        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
            stop_token_ids=stop, skip_special_tokens=True,
            logit_bias={special_id(policy.tokenizer, t): -100.0 for t in VISION_TOKENS})
        prompts = []
        for messages, enc in zip(batch_messages, encs):
            # The images resized to exactly what the HF path saw, so vLLM's own resize is a no-op
            # and its prompt equals enc.input_ids (which the trainer will score).
            images = [p["image"].convert("RGB").resize(size, Image.BICUBIC)
                      for p, size in zip(image_parts(messages), enc.image_sizes)]
            prompt = {"prompt_token_ids": collapse_image_pads(enc.input_ids, pad)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        gens = []
        for enc, out in zip(encs, outs):
            c = out.outputs[0]
            ids = list(c.token_ids)
            # Processed log-probs (see __init__): the sampled token's under the sampling distribution.
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

