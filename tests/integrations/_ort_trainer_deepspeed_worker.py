"""One process (rank 0 of 1): a tiny GPT-2 trained by ORTTrainer without and then with DeepSpeed
ZeRO-1 (the upstream examples' `--deepspeed ds_config_zero_1.json`), evaluated, saved and
reloaded into plain transformers. Prints one JSON line: the losses of both runs, the eval loss,
the saved checkpoint folders and whether the reload worked."""

from __future__ import annotations

import json
import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from onnxtrain.integrations.huggingface import ORTTrainer, ORTTrainingArguments  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip its shared-memory JIT build
torch.set_num_threads(1)
out = sys.argv[1]
config = {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "train_batch_size": "auto",
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
data = [{"input_ids": ids, "labels": ids.clone()}
        for ids in torch.randint(0, 50, (16, 10), generator=torch.Generator().manual_seed(0))]
result = {}
for name, extra in (("plain", {}), ("deepspeed", {"deepspeed": config})):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2,
                                                                 n_positions=32, resid_pdrop=0, embd_pdrop=0,
                                                                 attn_pdrop=0))
    args = ORTTrainingArguments(f"{out}/{name}", max_steps=4, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none",
                                use_cpu=True, save_strategy="steps", save_steps=2, disable_tqdm=True, seed=0, **extra)
    trainer = ORTTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4])
    trainer.train()
    result[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
result["eval_loss"] = trainer.evaluate()["eval_loss"]
result["checkpoints"] = sorted(p for p in os.listdir(f"{out}/deepspeed") if p.startswith("checkpoint-"))
trainer.save_model(f"{out}/final")
transformers.GPT2LMHeadModel.from_pretrained(f"{out}/final")
result["reloaded"] = True
print("RESULT " + json.dumps(result))
