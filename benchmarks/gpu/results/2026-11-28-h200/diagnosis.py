"""What wrote diagnosis.log (run from the repository root, PYTHONPATH=src): why bf16 missed fp32 in the CUDA
recompute test (dropout masks by dtype?), and BERT-base alone, fp32 against bf16, cold and warm."""
import sys
import time

import torch

sys.path[:0] = ["tests", "tests/unit"]
from test_step import _local_gradients  # noqa: E402

cuda = torch.device("cuda")
masks = []
for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    masks.append(torch.nn.functional.dropout(torch.ones(4096, device=cuda, dtype=dtype), 0.5) != 0)
print("CUDA dropout masks equal across fp32/bf16 from one seed:", bool(torch.equal(*masks)), flush=True)
for dropout in (True, False):
    fp32 = _local_gradients((), None, cuda, dropout=dropout)
    bf16 = _local_gradients((), torch.bfloat16, cuda, dropout=dropout)
    print(f"dropout={dropout}: bf16 vs fp32 worst relative gradient error",
          max(float((g - p).norm() / p.norm()) for g, p in zip(bf16, fp32)), flush=True)

from transformers import BertConfig, BertModel  # noqa: E402

model = BertModel(BertConfig(attn_implementation="sdpa")).to(cuda)
mask = torch.ones(32, 128, dtype=torch.int64, device=cuda)
mask[:, 100:] = 0
for dtype in (None, torch.bfloat16, None, torch.bfloat16):
    times = []
    for step in range(20):
        ids = torch.randint(0, 30522, (32, 64 + 16 * (step % 5)), device=cuda)  # five padded lengths, as text has
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(input_ids=ids, attention_mask=mask[:, :ids.shape[1]]).last_hidden_state
        out.float().mean().backward()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    print(f"HF bert-base {dtype}: first five steps {[round(t) for t in times[:5]]} ms, median of the rest "
          f"{sorted(times[5:])[7]:.1f} ms", flush=True)
