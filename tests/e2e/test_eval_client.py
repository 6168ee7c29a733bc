"""An existing evaluation client, unchanged, against `pdserve up`: lm-evaluation-harness's
`local-completions` model scores a log-likelihood task (echo + logprobs + max_tokens 0) that
this test writes itself, offline. Its continuations are the tiny model's greedy next tokens
(from transformers), so the harness's `acc` (is the continuation the greedy one?) must be 1:
that needs right logprobs, top-logprobs and token alignment all the way through."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ray
import torch
from pdserve_up import pdserve_up
from reference import hf_model
from transformers import AutoTokenizer

CONTEXTS = ["The sea was calm and", "Once upon a time", "She opened the door",
            "Numbers: 1 2 3", "In the morning we", "The old man said"]  # fmt: skip


def greedy_docs(model_dir: Path) -> list[dict[str, str]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = hf_model(model_dir)
    docs = []
    for context in CONTEXTS:
        ids = tokenizer(context, add_special_tokens=False)["input_ids"]  # as the harness sends
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        target = tokenizer.decode([token])
        again = tokenizer(context + target, add_special_tokens=False)["input_ids"]
        if again == [*ids, token]:  # survives re-encoding
            docs.append({"context": context, "target": target})
    return docs


def test_lm_eval_scores_a_loglikelihood_task_through_the_router(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    docs = greedy_docs(tiny_model_dir)
    assert len(docs) >= 3
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "pdserve_greedy.yaml").write_text(
        "task: pdserve_greedy\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'data.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    config = (
        f"engine:\n  model: {tiny_model_dir}\n  torch_threads: 1\n  num_kv_blocks: 128\n"
        f"prefill:\n  num_cpus: 1\ndecode:\n  num_cpus: 1\n"
        f"router:\n  port: 0\n  model_name: tiny\nadmin:\n  port: 0\n"
        f"cluster:\n  namespace: pdserve-lm-eval\n  state_dir: {tmp_path}\n"
    )
    with pdserve_up(config, tmp_path, ray.get_runtime_context().gcs_address) as up:
        offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "none"}
        model_args = (f"base_url={up.router_url}/completions,model=tiny,tokenizer={tiny_model_dir},"
                      "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")  # fmt: skip
        command = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
                   "--model_args", model_args, "--tasks", "pdserve_greedy",
                   "--include_path", str(tmp_path),
                   "--output_path", str(tmp_path / "out")]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env={**os.environ, **offline})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]["pdserve_greedy"]
    assert scores["acc,none"] == 1.0
