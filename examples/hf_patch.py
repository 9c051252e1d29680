"""Patch a small transformers MoE model (Qwen3-MoE, random init) with mokgen, train a few steps
and print tokens/s before and after patching. Needs a GPU for the kernels."""
import copy
import time

import torch
import transformers

import mokgen


def tokens_per_s(model, steps=10, batch=8, seq=256):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (batch, seq), device="cuda")
    for i in range(steps + 3):
        if i == 3:  # warm-up done (compiles, allocator)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return steps * batch * seq / (time.perf_counter() - t0), loss.item()


def main():
    cfg = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                                      moe_intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                      num_experts=32, num_experts_per_tok=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).cuda().bfloat16()
    patched = copy.deepcopy(model)
    names = mokgen.patch(patched)
    before, loss_b = tokens_per_s(model)
    after, loss_a = tokens_per_s(patched)
    print(f"patched {len(names)} MoE blocks; training tokens/s: transformers {before:.0f}, "
          f"mokgen {after:.0f} ({after / before:.2f}x); last losses {loss_b:.4f} / {loss_a:.4f}")
    print("(forward and backward: mokgen's megakernels; attention, norms and the LM head are "
          "transformers' own)")


if __name__ == "__main__":
    if not torch.cuda.is_available():  # it times the kernels; the README's quickstart 2 runs
        raise SystemExit("hf_patch.py needs a CUDA GPU (sm_90a): it times mokgen's kernels "
                         "against transformers'; on CPU, see the README's quickstart 2")
    main()
