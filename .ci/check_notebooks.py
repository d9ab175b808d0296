#!/usr/bin/env python
"""Check that every notebook opens the way the course's notebooks open (CONVENTIONS: notebook template).

    python .ci/check_notebooks.py            # prints one `PASS: ...` / `FAIL: ...` line per check

For each notebook nbdev sees (nbs/**/*.ipynb, skipping `_`/`.` names), four checks:
  opening   the first cell is markdown: `# Title` then a `> one-line summary` (the docs page title and summary)
  colab     a markdown cell links "Open In Colab" to this notebook's own path in the repository
  install   the first code cell is `#| hide` and pip-installs the package when running in Colab
  outputs   no error outputs (tracebacks) are committed
Exit status 1 if any check failed.
"""
import json, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def settings():
    from configparser import ConfigParser
    c = ConfigParser(delimiters=['='])
    c.read(ROOT / 'settings.ini', encoding='utf-8')
    d = c['DEFAULT']
    return {k: d.get(k) for k in ('user', 'repo', 'branch', 'nbs_path', 'git_url', 'recursive')}


def notebooks(nbs):
    "The notebooks nbdev processes: skip files and folders whose name starts with `_` or `.`."
    out = []
    for p in sorted(nbs.rglob('*.ipynb')):
        rel = p.relative_to(nbs)
        if any(part.startswith(('_', '.')) for part in rel.parts): continue
        out.append(p)
    return out


def src(c): return c['source'] if isinstance(c['source'], str) else ''.join(c['source'])


def check_nb(path, s):
    "[(check name, problem or None)] for one notebook."
    rel = path.relative_to(ROOT).as_posix()
    try: nb = json.loads(path.read_text(encoding='utf-8'))
    except Exception as e: return [('readable', f'cannot parse: {e}')]
    cells = nb.get('cells', [])
    res = []

    # opening: "# Title" and "> summary"
    first = cells[0] if cells else None
    prob = None
    if not first or first['cell_type'] != 'markdown': prob = 'the first cell must be markdown: "# Title" then "> summary"'
    else:
        lines = [l for l in src(first).strip().splitlines() if l.strip()]
        if not lines or not re.match(r'^# [^#\s]', lines[0]):
            prob = f'the first line of the first cell must be a "# Title" heading, not {lines[0][:40]!r}' if lines else 'empty first cell'
        elif len(lines) < 2 or not lines[1].startswith('> '): prob = 'the line after the title must be a "> one-line summary"'
    res.append(('opening', prob))

    # colab badge linking to this very notebook
    url = f"https://colab.research.google.com/github/{s['user']}/{s['repo']}/blob/{s['branch']}/{rel}"
    md = '\n'.join(src(c) for c in cells if c['cell_type'] == 'markdown')
    if f'({url})' in md and 'colab-badge.svg' in md: prob = None
    else:
        found = re.findall(r'https://colab\.research\.google\.com/github/[^)\s]+', md)
        prob = (f'the Colab link points to {found[0]}, expected {url}' if found else
                f'no "Open In Colab" badge: add a markdown cell [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})')
    res.append(('colab', prob))

    # the hidden Colab install cell: the first code cell
    code = [c for c in cells if c['cell_type'] == 'code']
    prob = None
    if not code: prob = 'no code cells: the first code cell must be the hidden Colab install cell'
    else:
        c0 = src(code[0])
        git = s['git_url'].rstrip('/')
        if not c0.lstrip().startswith('#| hide'): prob = 'the first code cell must start with "#| hide" (the Colab install cell)'
        elif "'google.colab' in sys.modules" not in c0 and '"google.colab" in sys.modules' not in c0:
            prob = "the first code cell must test `'google.colab' in sys.modules`"
        elif 'pip' not in c0 or 'install' not in c0 or f'git+{git}' not in c0:
            prob = f'the first code cell must pip-install git+{git} in Colab'
    res.append(('install', prob))

    # no error outputs
    bad = []
    for i, c in enumerate(cells):
        for o in c.get('outputs', []) or []:
            if o.get('output_type') == 'error': bad.append(f"cell {i}: {o.get('ename')}: {o.get('evalue', '')[:80]}")
            elif o.get('output_type') == 'stream' and 'Traceback (most recent call last)' in src({'source': o.get('text', '')}):
                bad.append(f'cell {i}: a traceback in {o.get("name")}')
    res.append(('outputs', ('error outputs: ' + '; '.join(bad)) if bad else None))
    return res


def main():
    s = settings()
    nbs = ROOT / (s['nbs_path'] or 'nbs')
    nbl = notebooks(nbs)
    failed = 0
    if not nbl:
        print(f'FAIL: notebooks: none found in {nbs}'); return 1
    for p in nbl:
        for name, prob in check_nb(p, s):
            rel = p.relative_to(ROOT).as_posix()
            if prob: print(f'FAIL: {rel} {name}: {prob}'); failed += 1
            else: print(f'PASS: {rel} {name}')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
