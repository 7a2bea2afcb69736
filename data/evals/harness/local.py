"""
The data of the task files in this folder, for lm-evaluation-harness's `custom_dataset`: read
from this folder (or the shipped sample), whatever the working directory, with no download
and no dataset cache. Each function returns a DatasetDict with a 'test' split; the keyword
arguments the harness passes (the task's metadata) are not needed.
"""

import gzip
import hashlib
import json
from pathlib import Path

from datasets import Dataset, DatasetDict

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parents[1] / 'sample' / 'fineweb_edu_sample.jsonl.gz'


def _jsonl(path):
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rt', encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]


def arc_easy_100(**metadata):
    """100 ARC-Easy test questions in the Hugging Face allenai/ai2_arc schema (SOURCES.md)."""
    return DatasetDict({'test': Dataset.from_list(_jsonl(HERE / 'arc_easy_100.jsonl'))})


def gsm8k_10(**metadata):
    """The first 10 GSM8K test problems, {question, answer} (SOURCES.md)."""
    return DatasetDict({'test': Dataset.from_list(_jsonl(HERE / 'gsm8k_10.jsonl'))})


def webtext_8(**metadata):
    """The first 8 documents of the shipped web-text sample's validation split, {text}: a
    document is in it iff the first 8 bytes of sha1(text), as a fraction of 2^64, are below
    0.03 (data/fineweb_edu/prepare.py --sample, doc_hash and SAMPLE_VAL_FRACTION), so a model
    trained by the quick start has not seen them."""
    val = [d for d in _jsonl(SAMPLE)
           if int.from_bytes(hashlib.sha1(d['text'].encode('utf-8')).digest()[:8], 'big') / 2**64 < 0.03]
    return DatasetDict({'test': Dataset.from_list([{'text': d['text']} for d in val[:8]])})
