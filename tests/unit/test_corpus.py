"""A language model's data and task: documents split before packing, windows whose targets are the next tokens, a
loss that sums over tokens and a per-row negative log-likelihood; and the one-line refusals around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipetransformer.config import ConfigError, load_config
from pipetransformer.data.batch import SampleLimits
from pipetransformer.data.corpus import END_OF_TEXT, TokenWindows, decode_bytes, encode_bytes, load_corpus
from pipetransformer.train.task import causal_lm, task_for

LENGTH = 16


def write_csv(path: Path, texts: list[str]) -> Path:
    path.write_text("text,label\n" + "".join(f'"{text}",x\n' for text in texts), encoding="utf-8")
    return path


def test_bytes_round_trip_through_the_end_of_text_token() -> None:
    tokens = encode_bytes("naïve café")
    assert tokens[-1] == END_OF_TEXT and max(tokens[:-1]) < 256
    assert decode_bytes(tokens + encode_bytes("next")) == "naïve café"


def test_windows_hold_the_next_token_at_every_position() -> None:
    windows = TokenWindows.packed(["abcdefghij", "klmnopqrstuvwxyz"], max_length=4)
    batch = windows.get_batch(list(range(len(windows))))
    ids, targets = batch.inputs[0], batch.labels
    assert torch.equal(ids.flatten()[1:], targets.flatten()[:-1])  # windows overlap by one token, in order
    assert torch.equal(batch.inputs[1], torch.ones_like(ids))
    assert windows.num_classes == END_OF_TEXT + 1
    assert decode_bytes(ids.flatten().tolist()) == "abcdefghij"


def test_documents_are_split_before_packing_so_no_window_mixes_the_splits(tmp_path: Path) -> None:
    texts = [f"document number {i:03d} says its own words" for i in range(60)]
    splits = load_corpus("text_csv", path=write_csv(tmp_path / "t.csv", texts), max_length=LENGTH, seed=3)
    seen = []
    for part in splits:
        stream = decode_bytes(part.get_batch(list(range(len(part)))).inputs[0].flatten().tolist()
                              + [END_OF_TEXT])
        seen.append({t for t in texts if t[:20] in stream})
    train, validation, test = seen
    assert validation and test and not (train & validation) and not (train & test) and not (validation & test)
    again = load_corpus("text_csv", path=tmp_path / "t.csv", max_length=LENGTH, seed=3)
    assert torch.equal(again.test.input_ids, splits.test.input_ids)


def test_sample_limits_count_windows(tmp_path: Path) -> None:
    texts = [f"text {i} " * 8 for i in range(50)]
    splits = load_corpus("text_csv", path=write_csv(tmp_path / "t.csv", texts), max_length=LENGTH,
                         limits=SampleLimits(10, 3, 2))
    assert [len(part) for part in splits] == [10, 3, 2]


def test_too_little_text_for_one_window_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="make no window of data.max_length=64 inputs: add text or lower"):
        TokenWindows.packed(["short"], max_length=64)


def test_the_loss_sums_every_tokens_cross_entropy_and_the_metric_is_each_rows_mean() -> None:
    task = causal_lm()
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(1))
    per_token = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(task.loss(logits, targets), per_token.sum())
    torch.testing.assert_close(task.sample_metric(logits, targets), per_token.mean(dim=1))
    assert task.metric == "nll" and not task.higher_is_better
    assert task_for("decoder").metric == "nll" and task_for("vit").metric == "accuracy"


def test_a_decoder_on_images_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="does not fit model.kind=decoder"):
        load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_decoder.yaml", ["data.name=fashion_mnist"])


def test_a_decoder_fine_tunes_an_earlier_runs_weights_when_the_settings_match(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from pipetransformer.models import build_model

    settings = {"dim": 32, "depth": 2, "heads": 4, "max_positions": 16}
    torch.manual_seed(0)
    trained = build_model("decoder", num_labels=257, decoder=settings)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(path))
    loaded = build_model("decoder", num_labels=257, decoder=settings, path=str(path))
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(ValueError, match="do not fit model.decoder .*use the model.decoder settings of the run"):
        build_model("decoder", num_labels=257, decoder={**settings, "max_positions": 32}, path=str(path))


def test_a_decoders_run_continues_prompts_and_exports_as_gpt2_that_generates_the_same(tmp_path: Path) -> None:
    """The export is the standard GPT-2 class with a byte-level tokenizer giving the run's ids: its logits are the
    run's, and ``generate`` (greedy, with its key-value cache) continues a prompt as ``predict`` does."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipetransformer.export import EXACT_ATOL, export_command
    from pipetransformer.predict import continue_prompts, load_run_model
    from pipetransformer.train.build import build_blocks

    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_decoder.yaml"
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.read_text())
    (run_dir / "summary.json").write_text(json.dumps({"class_names": [], "test_nll": 2.5, "steps": 10}))
    torch.manual_seed(0)
    model = build_blocks(load_config(config), 257, torch.device("cpu"))
    with torch.no_grad():  # weights far from init, so the logits tell the models apart
        for parameter in model.parameters():
            parameter.normal_(std=0.3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(run_dir / "model.safetensors"))
    run = load_run_model(run_dir)
    prompt, new = "The film is é", 12
    continued = continue_prompts(run, [prompt], max_new_tokens=new)[0]
    export_command(run_dir, out, "final")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert type(exported).__name__ == "GPT2LMHeadModel" and ids[0].tolist() == list(prompt.encode("utf-8"))
    with torch.no_grad():
        gap = (exported(input_ids=ids).logits - run.model(ids, torch.ones_like(ids))).abs().max()
    assert gap <= EXACT_ATOL
    generated = exported.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  do_sample=False, eos_token_id=256, pad_token_id=256)[0, ids.shape[1]:].tolist()
    assert tokenizer.decode([t for t in generated if t != 256]) == continued
    assert "perplexity" in (out / "README.md").read_text()


def test_instruction_rows_learn_the_response_only_and_keep_it_when_trimmed() -> None:
    windows = TokenWindows.examples(["Q: hi? A:", "Q: and the long one? A:"], [" yes", " no"], max_length=40)
    batch = windows.get_batch([0, 1])
    ids, targets, mask = batch.inputs[0], batch.labels, batch.inputs[1]
    assert ids.shape == targets.shape == (2, 26)  # trimmed to the longer example (27 tokens), targets with it
    learned = [bytes(t for t in row.tolist() if 0 <= t < END_OF_TEXT) for row in targets]
    assert learned == [b" yes", b" no"]
    first = len("Q: hi? A:") - 1  # the prompt's last token predicts the response's first
    assert targets[0, :first].eq(-100).all() and targets[0, first] == ord(" ")
    assert targets[0, mask[0].sum():].eq(-100).all()  # no target past the row's end
    padded = windows.get_batch([0], pad_to=48)
    assert padded.labels.shape == (1, 48) and padded.labels[0, 40:].eq(-100).all()


def test_an_example_whose_prompt_fills_the_window_is_left_out_and_none_left_is_an_error() -> None:
    assert len(TokenWindows.examples(["x" * 50, "Q:"], ["lost", " kept"], max_length=40)) == 1
    with pytest.raises(ValueError, match="no response fits data.max_length=8 after its prompt"):
        TokenWindows.examples(["a long prompt"], ["answer"], max_length=8)


def test_instruction_data_is_for_a_decoder_reading_a_csv() -> None:
    with pytest.raises(ConfigError, match="data.response_column .* is for model.kind: decoder or hf_decoder with"):
        load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_decoder.yaml",
                    ["data.response_column=answer"])
