"""
Prepare the evaluation sets of DepthBench (paper, arXiv 2609.32534, Figs. 4 and 8 left) as one
normalised jsonl file per task, so that probes/evals.py never needs to know a source schema.

Run from the repo root:

    python data/evals/prepare.py                                  # local files in ../shared/data
    python data/evals/prepare.py --input_dir DIR --tasks arc_easy mbpp
    python data/evals/prepare.py --file gpqa=/path/to/gpqa_diamond.csv
    python data/evals/prepare.py --hub                            # fetch missing sets from the HF hub

It writes data/evals/<task>.jsonl and data/evals/manifest.json (counts, sources, notes):

    multiple choice (arc_easy):  {"task", "id", "prompt", "choices": [raw choice texts], "gold": int}
    completion NLL (the rest):   {"task", "id", "prompt", "answer"}

Prompt and answer strings follow the study exactly (see docs/probes.md, evaluations):

    arc_easy   "Question: {question}\\nAnswer:"  + each continuation " {choice}"   (lm-eval arc_easy)
    mbpp       "You are an expert Python programmer, and here is your task: {text} Your code should
               pass these tests:\\n\\n{t1}\\n{t2}\\n{t3}\\n[BEGIN]\\n"  ->  code (+ "\\n" if missing)
    humaneval  prompt as is  ->  canonical_solution
    sciq       "Question: {question}\\nAnswer:"  ->  " {correct_answer}\\nExplanation: {support}"
    gpqa       "Question: {Q}\\nChoices:\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:" (choices shuffled by
               random.Random(seed), seed = first 8 bytes, big-endian, of sha256(Record ID))
               ->  " {correct answer}" + "\\nExplanation: {Explanation}" if there is one
    gsm8k      "Question: {question}\\nAnswer:"  ->  " {answer}"  (rationale and "#### N")
    math500    "Problem:\\n{problem}\\n\\nSolution:"  ->  " {solution}"

Where a prompt ends in a non-space and its answer starts with a non-space, one space is
put in front of the answer (the study's rule). MBPP keeps only the 500 test tasks 11-510.

Sources, in order: a `--file task=PATH` override; a file with a known name in --input_dir
(jsonl, jsonl.gz, csv or parquet, see LOCAL_FILES); with --hub, `datasets.load_dataset` on
the ids the study used (see HUB). A task with no data is skipped with a one-line notice.
On the offline copy of ../shared/data this prints:

    arc_easy    2,376  <- arc_easy_test.jsonl (test)
    sciq        1,000  <- sciq_validation.jsonl (validation)
               note: SciQ: local file is the validation split; the study used test (allenai/sciq)
    skip gpqa: no data (looked for gpqa_diamond.csv, ...); pass --file gpqa=PATH or --hub; GPQA is gated: ...
    gsm8k       1,319  <- gsm8k_test.jsonl (test)
    math500       500  <- math500_test.jsonl (test)
    mbpp          500  <- mbpp.jsonl (full)
               note: MBPP: kept the 500 test tasks with ids 11-510 of 974 records
    humaneval     164  <- HumanEval.jsonl.gz (test)
"""

import argparse
import csv
import gzip
import hashlib
import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_INPUT_DIR = REPO_ROOT.parent / 'shared' / 'data'
DEFAULT_OUT_DIR = REPO_ROOT / 'data' / 'evals'

TASKS = ['arc_easy', 'sciq', 'gpqa', 'gsm8k', 'math500', 'mbpp', 'humaneval']

# known local file names per task, first found wins: (file name, split it holds)
LOCAL_FILES = {
    'arc_easy': [('arc_easy_test.jsonl', 'test'), ('ARC-Easy-Test.jsonl', 'test'),
                 ('arc_easy_test.parquet', 'test')],
    'sciq': [('sciq_test.jsonl', 'test'), ('sciq_test.parquet', 'test'),
             ('sciq_validation.jsonl', 'validation'), ('sciq_validation.parquet', 'validation')],
    'gpqa': [('gpqa_diamond.csv', 'train'), ('gpqa_diamond.jsonl', 'train'),
             ('gpqa_diamond.parquet', 'train')],
    'gsm8k': [('gsm8k_test.jsonl', 'test'), ('gsm8k_test.parquet', 'test')],
    'math500': [('math500_test.jsonl', 'test'), ('math500_test.parquet', 'test')],
    'mbpp': [('mbpp.jsonl', 'full'), ('mbpp_test.jsonl', 'test'), ('mbpp_test.parquet', 'test')],
    'humaneval': [('HumanEval.jsonl.gz', 'test'), ('HumanEval.jsonl', 'test'),
                  ('humaneval_test.parquet', 'test')],
}
# HuggingFace hub (dataset id, config, split) as in the study (docs/probes.md, evaluations)
HUB = {
    'arc_easy': ('allenai/ai2_arc', 'ARC-Easy', 'test'),
    'sciq': ('allenai/sciq', None, 'test'),
    'gpqa': ('Idavidrein/gpqa', 'gpqa_diamond', 'train'),
    'gsm8k': ('openai/gsm8k', 'main', 'test'),
    'math500': ('HuggingFaceH4/MATH-500', 'default', 'test'),
    'mbpp': ('google-research-datasets/mbpp', 'full', 'test'),
    'humaneval': ('openai/openai_humaneval', None, 'test'),
}
# how many records the study evaluated per task
EXPECTED_COUNTS = {'arc_easy': 2376, 'sciq': 1000, 'gpqa': 198, 'gsm8k': 1319,
                   'math500': 500, 'mbpp': 500, 'humaneval': 164}
MBPP_TEST_IDS = range(11, 511)  # the standard MBPP test split: task ids 11..510

# -----------------------------------------------------------------------------
# reading raw files

def read_records(path):
    """Read a list of dict records from a .jsonl, .jsonl.gz, .json (a list), .csv or .parquet file.
    Raises FileNotFoundError if absent, ValueError (naming file and line) if it does not parse."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; check the path given to --file or --input_dir")
    name = path.name.lower()
    if name.endswith('.parquet'):
        import pyarrow.parquet as pq  # only needed for parquet shards
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:
            raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    if name.endswith('.csv'):
        with open(path, newline='', encoding='utf-8-sig') as f:  # tolerate a BOM from spreadsheet exports
            return list(csv.DictReader(f))
    opener = gzip.open if name.endswith('.gz') else open
    try:
        with opener(path, 'rt', encoding='utf-8') as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as UTF-8 text ({e})") from None
    if name.endswith('.json'):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a JSON list of records; use jsonl for one record per line")
        return records
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected one JSON object per line") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        records.append(rec)
    return records


def _get(rec, field, where):
    # one helper so every missing field gets the same one-line error naming file, record and field
    if not isinstance(rec, dict) or field not in rec or rec[field] is None:
        raise ValueError(f"{where}: missing required field '{field}'")
    return rec[field]


def _ensure_leading_separator(prompt, answer):
    # the study puts one space between a prompt ending in a non-space and an answer starting in one
    if answer and prompt and not prompt[-1].isspace() and not answer[0].isspace():
        return ' ' + answer
    return answer

# -----------------------------------------------------------------------------
# one formatter per task: raw record -> normalised record (or None to drop it)

def format_arc_easy(rec, i, where):
    """AI2 format {"question": {"stem", "choices": [{"text", "label"}]}, "answerKey"} or the
    HF ai2_arc format {"question": str, "choices": {"text": [...], "label": [...]}, "answerKey"}."""
    q = _get(rec, 'question', where)
    if isinstance(q, dict):  # original AI2 release
        stem = _get(q, 'stem', where + " question")
        choices = _get(q, 'choices', where + " question")
        texts = [_get(c, 'text', where + " choice") for c in choices]
        labels = [str(_get(c, 'label', where + " choice")) for c in choices]
    else:  # HuggingFace allenai/ai2_arc
        stem = q
        choices = _get(rec, 'choices', where)
        texts, labels = list(_get(choices, 'text', where + " choices")), [str(l) for l in _get(choices, 'label', where + " choices")]
    key = str(_get(rec, 'answerKey', where))
    if len(texts) < 2 or len(texts) != len(labels):
        raise ValueError(f"{where}: field 'choices' needs >= 2 choices, each with a text and a label")
    if key not in labels:  # some items use labels "1".."4" instead of "A".."D": match, never assume
        raise ValueError(f"{where}: field 'answerKey' is {key!r}, not one of the labels {labels}")
    if any(len(t) == 0 for t in texts):
        raise ValueError(f"{where}: field 'choices' has an empty choice text (acc_norm divides by its length)")
    return {'task': 'arc_easy', 'id': str(rec.get('id', i)), 'prompt': f"Question: {stem}\nAnswer:",
            'choices': texts, 'gold': labels.index(key)}


def format_sciq(rec, i, where):
    prompt = f"Question: {_get(rec, 'question', where)}\nAnswer:"
    # the study scores the support passage too, even when it is empty
    answer = f"{_get(rec, 'correct_answer', where)}\nExplanation: {_get(rec, 'support', where)}"
    return {'task': 'sciq', 'id': f"sciq/{i}", 'prompt': prompt, 'answer': _ensure_leading_separator(prompt, answer)}


def format_gpqa(rec, i, where):
    correct = str(_get(rec, 'Correct Answer', where)).strip()
    choices = [correct] + [str(_get(rec, f'Incorrect Answer {k}', where)).strip() for k in (1, 2, 3)]
    record_id = str(rec.get('Record ID') or _get(rec, 'Question', where))
    seed = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], 'big')
    random.Random(seed).shuffle(choices)  # per-question, reproducible order of the four answers
    rendered = "\n".join(f"{chr(ord('A') + k)}. {c}" for k, c in enumerate(choices))
    prompt = f"Question: {str(_get(rec, 'Question', where)).strip()}\nChoices:\n{rendered}\nAnswer:"
    answer = correct
    explanation = str(rec.get('Explanation') or '').strip()
    if explanation:
        answer += f"\nExplanation: {explanation}"
    return {'task': 'gpqa', 'id': record_id, 'prompt': prompt, 'answer': _ensure_leading_separator(prompt, answer)}


def format_gsm8k(rec, i, where):
    prompt = f"Question: {_get(rec, 'question', where)}\nAnswer:"
    answer = str(_get(rec, 'answer', where))  # full rationale ending in "#### N"
    return {'task': 'gsm8k', 'id': f"gsm8k/{i}", 'prompt': prompt, 'answer': _ensure_leading_separator(prompt, answer)}


def format_math500(rec, i, where):
    prompt = f"Problem:\n{_get(rec, 'problem', where)}\n\nSolution:"
    answer = rec.get('solution') or rec.get('answer')  # the study falls back to the short answer
    if not answer:
        raise ValueError(f"{where}: missing required field 'solution'")
    return {'task': 'math500', 'id': str(rec.get('unique_id', i)), 'prompt': prompt,
            'answer': _ensure_leading_separator(prompt, str(answer))}


def format_mbpp(rec, i, where):
    task_id = int(_get(rec, 'task_id', where))
    if task_id not in MBPP_TEST_IDS:
        return None
    tests = list(_get(rec, 'test_list', where))
    tests += [''] * (3 - len(tests))  # the prompt always shows three test lines
    prompt = ("You are an expert Python programmer, and here is your task: "
              f"{_get(rec, 'text', where)} Your code should pass these tests:\n\n"
              f"{tests[0]}\n{tests[1]}\n{tests[2]}\n[BEGIN]\n")
    code = str(_get(rec, 'code', where))
    answer = code if code.endswith('\n') else code + '\n'  # no [DONE] marker is scored
    return {'task': 'mbpp', 'id': f"mbpp/{task_id}", 'prompt': prompt, 'answer': answer}


def format_humaneval(rec, i, where):
    # the prompt ends inside the function (after the docstring); the solution follows with no separator
    return {'task': 'humaneval', 'id': str(_get(rec, 'task_id', where)), 'prompt': str(_get(rec, 'prompt', where)),
            'answer': str(_get(rec, 'canonical_solution', where))}


FORMATTERS = {'arc_easy': format_arc_easy, 'sciq': format_sciq, 'gpqa': format_gpqa, 'gsm8k': format_gsm8k,
              'math500': format_math500, 'mbpp': format_mbpp, 'humaneval': format_humaneval}

# -----------------------------------------------------------------------------
# finding sources and writing outputs

def _guess_split(path):
    name = Path(path).name.lower()
    return 'validation' if 'valid' in name else 'test' if 'test' in name else 'unknown'


def find_source(task, input_dir, files, hub):
    """-> (records, source description, split) or None when the task has no data."""
    if task in files:
        path = Path(files[task])
        return read_records(path), str(path), _guess_split(path)
    for fname, split in LOCAL_FILES[task]:
        path = Path(input_dir) / fname
        if path.is_file():
            return read_records(path), str(path), split
    if hub:
        from datasets import load_dataset  # only imported when the hub is wanted
        name, config, split = HUB[task]
        try:
            ds = load_dataset(name, config, split=split) if config else load_dataset(name, split=split)
        except Exception as e:  # no network, gated dataset, ...: skip like a missing file
            print(f"skip {task}: hub load of {name} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            return None
        return [dict(r) for r in ds], f"hf:{name}" + (f"/{config}" if config else ''), split
    return None


def format_task(task, records, source):
    """Normalise the raw records of one task. Raises ValueError naming source, record and field."""
    out = []
    for i, rec in enumerate(records):
        item = FORMATTERS[task](rec, i, f"{source}: record {i}")
        if item is not None:
            out.append(item)
    if not out:
        raise ValueError(f"{source}: no usable {task} records (mbpp keeps only task ids 11-510)")
    return out


def write_jsonl(items, path):
    tmp = Path(str(path) + '.tmp')
    with open(tmp, 'w', encoding='utf-8') as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + '\n')
    tmp.replace(path)  # never leave a half-written task file behind


def prepare(tasks=TASKS, input_dir=DEFAULT_INPUT_DIR, out_dir=DEFAULT_OUT_DIR, files=None, hub=False):
    """Write out_dir/<task>.jsonl for every task with data and update out_dir/manifest.json.
    A task with no data keeps the file and manifest entry of an earlier run, if any.
    Returns the manifest dict. Raises ValueError on malformed input, FileNotFoundError on a bad
    --file or an input_dir that is not a folder (when some task needs it)."""
    files = files or {}
    if not hub and not Path(input_dir).is_dir() and any(t not in files for t in tasks):
        raise FileNotFoundError(f"--input_dir {input_dir} is not a folder; give the folder with the raw files, "
                                f"--file TASK=PATH for each task, or --hub")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / 'manifest.json'
    # keep entries of tasks not prepared in this run, so `--tasks gpqa --file ...` adds to a full run
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest.setdefault('tasks', {})
    manifest.setdefault('skipped', {})
    for task in tasks:
        found = find_source(task, input_dir, files, hub)
        if found is None:
            looked = ', '.join(f for f, _ in LOCAL_FILES[task])
            reason = f"no data (looked for {looked} in {input_dir}); pass --file {task}=PATH" + ('' if hub else ' or --hub')
            if task == 'gpqa':
                reason += "; GPQA is gated: get gpqa_diamond.csv from the authors (idavidrein/gpqa)"
            if task in manifest['tasks'] and (out_dir / f"{task}.jsonl").is_file():  # from an earlier run
                print(f"skip {task}: {reason}; keeping the {task}.jsonl prepared earlier")
                continue
            print(f"skip {task}: {reason}")
            manifest['skipped'][task] = reason
            manifest['tasks'].pop(task, None)
            (out_dir / f"{task}.jsonl").unlink(missing_ok=True)  # a stray file would be read as the task
            continue
        records, source, split = found
        items = format_task(task, records, source)
        write_jsonl(items, out_dir / f"{task}.jsonl")
        notes = []
        if task == 'mbpp':
            notes.append(f"MBPP: kept the {len(items)} test tasks with ids 11-510 of {len(records)} records")
        if task == 'sciq' and split != 'test':
            notes.append(f"SciQ: local file is the {split} split; the study used test (allenai/sciq)")
        if len(items) != EXPECTED_COUNTS[task]:
            notes.append(f"{task}: {len(items)} records, the study used {EXPECTED_COUNTS[task]}")
        entry = {'count': len(items), 'source': source, 'split': split, 'notes': notes}
        if Path(source).is_file():
            entry['sha256'] = hashlib.sha256(Path(source).read_bytes()).hexdigest()
        manifest['tasks'][task] = entry
        manifest['skipped'].pop(task, None)
        print(f"{task:<10} {len(items):>6,}  <- {Path(source).name if Path(source).is_file() else source} ({split})")
        for note in notes:
            print(f"           note: {note}")
    manifest['notes'] = ["Prompts and answers follow the study (docs/probes.md, evaluations: ARC-Easy and domain NLL).",
                         "STEM = SciQ + GPQA; a missing task leaves its category with one task."]
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + '\n')
    return manifest


def main(argv=None):
    parser = argparse.ArgumentParser(description="Normalise the DepthBench evaluation sets into data/evals/<task>.jsonl")
    parser.add_argument('--input_dir', default=str(DEFAULT_INPUT_DIR), help="folder with the raw files (default ../shared/data)")
    parser.add_argument('--tasks', nargs='+', default=TASKS, help=f"subset of {TASKS}")
    parser.add_argument('--out_dir', default=str(DEFAULT_OUT_DIR), help="where the task files go (default data/evals)")
    parser.add_argument('--file', action='append', default=[], metavar='TASK=PATH', help="use this raw file for a task")
    parser.add_argument('--hub', action='store_true', help="load tasks with no local file from the HuggingFace hub")
    args = parser.parse_args(argv)
    try:
        unknown = [t for t in args.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; choose from {TASKS}")
        files = {}
        for spec in args.file:
            task, sep, path = spec.partition('=')
            if not sep or task not in TASKS or not path:
                raise ValueError(f"--file {spec!r}: expected TASK=PATH with TASK one of {TASKS}")
            files[task] = path
        prepare(args.tasks, args.input_dir, args.out_dir, files, args.hub)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    main()
