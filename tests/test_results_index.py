"""benchmarks/results/ is the record: every file in it is listed in its README.md index, and every
results file a page cites (docs/, README.md, the component READMEs, the results' own run notes)
exists (a glob or a {a,b} choice must match at least one file)."""
import glob
import itertools
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
_CITED = re.compile(r"benchmarks/results/([A-Za-z0-9_.*{},\-]+)")


def _pages():
    pages = glob.glob(os.path.join(ROOT, "docs", "*.md")) + [os.path.join(ROOT, "README.md")]
    pages += glob.glob(os.path.join(ROOT, "cc", "**", "README.md"), recursive=True)
    pages += glob.glob(os.path.join(ROOT, "gpu_check", "README.md"))
    pages += glob.glob(os.path.join(RESULTS, "*README*"))
    return pages


def _expand(pattern):
    """'a_{x,y}.md' -> ['a_x.md', 'a_y.md']; no braces -> [pattern]."""
    parts = re.split(r"(\{[^{}]*\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def test_every_results_file_is_in_the_index():
    with open(os.path.join(RESULTS, "README.md")) as f:
        index = f.read()
    files = sorted(n for n in os.listdir(RESULTS) if n != "README.md" and not n.startswith("."))
    missing = [n for n in files if n not in index]
    assert files and not missing, f"not in benchmarks/results/README.md: {missing}"


def test_every_cited_results_file_exists():
    bad = []
    for page in _pages():
        with open(page) as f:
            text = f.read()
        for cited in _CITED.findall(text):
            cited = cited.rstrip(".,")
            for name in _expand(cited):
                if not glob.glob(os.path.join(RESULTS, name)):
                    bad.append(f"{os.path.relpath(page, ROOT)}: {name}")
    assert not bad, bad
