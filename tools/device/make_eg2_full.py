"""A full-size random-weight EmbeddingGemma 2 folder in the published layout, with the benchmark
inputs, for speed tests and full-size parity (the weights are random; speed does not depend on
them; for parity, tools/device/make_eg2_parity.py rescales the q/k norms of this folder).

    python3 make_eg2_full.py MODEL_DIR DATA_DIR [--tiny] [--no-audio]

MODEL_DIR gets the model (EmbeddingGemma2Model with the class-default text, vision and audio
configs, weights from torch.manual_seed(0), bf16, safetensors), a synthetic tokenizer.json
(262,144 ids: the Gemma special and media tokens at their published ids as special added tokens,
the printable ASCII characters and "▁" as single-character tokens, the 256 byte-fallback tokens,
the rest unused; no merges; "<bos> $A <eos>" framing), and the tokenizer, processor and
sentence-transformers configs. DATA_DIR gets bench_inputs.json (a 17-token query "short", a
2,208-token document "long", 64 documents of 64 tokens "batch64"), image/img_a_641x479.png
(random RGB) and audio/c_9p3s.wav (9.3 s of a 440 Hz tone in noise, 16 kHz). --no-audio leaves
the audio tower out of the model; --tiny makes a small model of the same layout. The model is built on the GPU when there is one.

Needs torch and transformers 5.25 (EmbeddingGemma 2), tokenizers, numpy."""
import json
import math
import struct
import sys
import time
import wave
import zlib
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from transformers.models.embedding_gemma2 import EmbeddingGemma2Config, EmbeddingGemma2Model

assert transformers.__version__ == "5.25.0", transformers.__version__

VOCAB = 262_144
SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 255_999: "<|image>",
           256_000: "<|audio>", 258_880: "<|image|>", 258_881: "<|audio|>", 258_882: "<image|>",
           258_883: "<audio|>", 258_884: "<|video|>"}
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def tokenizer() -> Tokenizer:
    """Special tokens at their ids, then one token per printable character and "▁", the 256
    byte-fallback tokens, and unused ids up to VOCAB (skipping the special ids)."""
    vocab = {text: i for i, text in SPECIAL.items()}
    nxt = 5
    for c in [chr(c) for c in range(33, 127)] + ["\u2581"]:
        vocab[c] = nxt
        nxt += 1
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = nxt
        nxt += 1
    i = nxt
    while len(vocab) < VOCAB:
        while i in SPECIAL:
            i += 1
        vocab[f"<unused{i}>"] = i
        i += 1
    assert len(vocab) == VOCAB and max(vocab.values()) == VOCAB - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True,
                               fuse_unk=False))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL.values()])
    return tok


def write_json(path: Path, value, indent=None):
    path.write_text(json.dumps(value, indent=indent))


def configs(mdir: Path):
    write_json(mdir / "tokenizer_config.json",
               {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"})
    write_json(mdir / "config_sentence_transformers.json",
               {"prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"})
    write_json(mdir / "processor_config.json", {
        "processor_class": "EmbeddingGemma2Processor",
        "image_processor": {"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 280,
                            "do_convert_rgb": True, "do_resize": True, "do_rescale": True,
                            "rescale_factor": 1 / 255, "do_normalize": False, "resample": 3},
        "video_processor": {"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 140,
                            "fps": 1, "max_frames": 32, "overflow_strategy": "uniform",
                            "add_timestamps": False},
        "feature_extractor": {"feature_size": 128, "sampling_rate": 16000, "fft_length": 512,
                              "frame_length": 320, "hop_length": 160, "min_frequency": 0.0,
                              "max_frequency": 8000.0, "mel_floor": 0.001},
    }, indent=1)


def model_config(tiny: bool, audio: bool) -> EmbeddingGemma2Config:
    if not tiny:
        return EmbeddingGemma2Config(text_config={}, vision_config={"model_type": "gemma4_vision"},
                                     audio_config={"model_type": "gemma4_audio"} if audio else None)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1, sliding_window=8, hidden_size_per_layer_input=24,
                embedding_dim=48)
    vision = dict(model_type="gemma4_vision", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=32, patch_size=16,
                  pooling_kernel_size=3)
    audio_cfg = dict(model_type="gemma4_audio", hidden_size=64, num_hidden_layers=1,
                     num_attention_heads=2) if audio else None
    return EmbeddingGemma2Config(text_config=text, vision_config=vision, audio_config=audio_cfg)


def png(path: Path, rgb: np.ndarray):
    """An 8-bit RGB PNG, no filtering."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def inputs(ddir: Path, tok: Tokenizer):
    short = "which red planet"[:15]                    # 15 chars: 17 ids with <bos>/<eos>
    long = ("lorem ipsum dolor sit amet " * 200)[:2206]  # 2,206 chars: 2,208 ids
    batch = [(f"document {i} about topic {i % 13} and more words here ok " * 3)[:62] for i in range(64)]
    write_json(ddir / "bench_inputs.json", {"short": short, "long": long, "batch64": batch})
    lens = (len(tok.encode(short).ids), len(tok.encode(long).ids), len(tok.encode(batch[0]).ids))
    assert lens == (17, 2208, 64), lens
    rng = np.random.default_rng(0)
    (ddir / "image").mkdir(parents=True, exist_ok=True)
    png(ddir / "image" / "img_a_641x479.png", rng.integers(0, 256, (479, 641, 3), dtype=np.uint8))
    (ddir / "audio").mkdir(parents=True, exist_ok=True)
    sr, n = 16000, int(9.3 * 16000)
    pcm = np.sin(np.arange(n) * 2 * math.pi * 440 / sr) * 8000 + rng.normal(0, 800, n)
    with wave.open(str(ddir / "audio" / "c_9p3s.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sr)
        f.writeframes(pcm.astype("<i2").tobytes())
    return lens


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 2:
        sys.exit(__doc__)
    mdir, ddir = map(Path, args)
    tiny, audio = "--tiny" in sys.argv, "--no-audio" not in sys.argv
    t0 = time.time()
    mdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    tok.save(str(mdir / "tokenizer.json"))
    configs(mdir)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = EmbeddingGemma2Model(model_config(tiny, audio)).to(torch.bfloat16)
    model.save_pretrained(mdir, safe_serialization=True)
    del model
    print(f"model saved ({time.time() - t0:.0f} s): {sorted(p.name for p in mdir.iterdir())}", flush=True)
    short, long, batch = inputs(ddir, tok)
    print(json.dumps({"model": str(mdir), "data": str(ddir), "short_ids": short, "long_ids": long,
                      "batch_ids": batch, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
