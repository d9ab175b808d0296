#!/usr/bin/env python
"""Check a built documentation site (prints one `PASS: ...` / `FAIL: ...` line per check).

    python .ci/check_docs.py SITE [--reference docs] [--warnings _proc/sphinx-warnings.txt]

Checks:
  page <nb>   a page per notebook, titled with the notebook's title and showing its one-line summary
  plots <nb>  the page shows (at least) every image output of the notebook that nbdev keeps visible, each with alt text
  nav         every page's left navigation lists every notebook, index first, then in course order
  errors      no error output, traceback or docutils error message on any page
  local-files every local image, script, stylesheet and link target exists (the site works from the filesystem)
  anchors     every link to a place in a page (`page.html#name`) finds an element with that id there
  math        pages with math load the local MathJax 3 (no network needed)
  layout      the stylesheet widens the content column and lets wide output tables scroll; every page loads it
  syntax      no leftover Quarto / nbdev syntax: front matter, `{target=...}`, `#|` lines, raw `$...$` or TeX, markdown
              links shown as text in code blocks
  warnings    the Sphinx build printed no warnings (with --warnings)
  fresh       the site matches the committed one in --reference (same pages, same text, same images)
Exit status 1 if any check failed.
"""
import argparse, json, posixpath, re, sys
from pathlib import Path
from urllib.parse import urlsplit, unquote

from bs4 import BeautifulSoup, CData, NavigableString, Tag

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_notebooks import notebooks, settings, src  # noqa: E402

results = []


def report(name, problems):
    problems = [p for p in problems if p]
    results.append((name, problems))
    if problems:
        shown = problems[:8] + ([f'... and {len(problems) - 8} more'] if len(problems) > 8 else [])
        print(f'FAIL: docs {name}: ' + '; '.join(shown))
    else: print(f'PASS: docs {name}')


def page_name(rel):
    "nbdev's page name for a notebook path relative to nbs/ (`00_data.ipynb` -> `data.html`)."
    p = Path(rel)
    return p.with_name(re.sub(r'^\d+[a-zA-Z0-9]*_', '', p.name.lower())).with_suffix('.html').as_posix()


def course_order(rels):
    "nbdev_sidebar's order: index first, then by folder and name."
    def key(r):
        p = Path(r)
        return (p.parent.as_posix(), '00' if p.name.startswith('index.') else p.name)
    return sorted(rels, key=key)


def nb_title_summary(nb):
    lines = [l for l in src(nb['cells'][0]).strip().splitlines() if l.strip()] if nb.get('cells') else []
    title = lines[0][2:].strip() if lines and lines[0].startswith('# ') else None
    summary = lines[1][2:].strip() if len(lines) > 1 and lines[1].startswith('> ') else None
    return title, summary


_hidden = {'hide', 'export', 'exporti', 'default_exp'}


def visible_images(nb):
    "Image outputs that nbdev keeps on the page (not in hidden / exported / output:false cells)."
    n = 0
    for c in nb.get('cells', []):
        if c['cell_type'] != 'code': continue
        d = {}
        for l in src(c).splitlines():
            m = re.match(r'^\s*#\|\s*([\w-]+)\s*:?\s*(.*)$', l)
            if not m: break
            d[m.group(1)] = m.group(2).strip().lower()
        if d.keys() & _hidden or d.get('output') == 'false' or d.get('include') == 'false': continue
        for o in c.get('outputs', []):
            if any(k.startswith('image/') for k in o.get('data', {})): n += 1
    return n


def soup(p): return BeautifulSoup(p.read_text(encoding='utf-8'), 'html.parser')


def article(s): return s.find('article', attrs={'role': 'main'}) or s.find('article') or s


def norm(t): return re.sub(r'\s+', ' ', t).strip()


def prose(tag):
    "`tag.get_text('\\n')` without what lies in code, scripts, styles and math (a walk: no copy of the tree to cut them from)."
    out, todo = [], list(reversed(tag.contents))
    while todo:
        n = todo.pop()
        if isinstance(n, Tag):
            if n.name not in ('pre', 'code', 'script', 'style') and 'math' not in n.get('class', ()): todo.extend(reversed(n.contents))
        elif type(n) in (NavigableString, CData): out.append(n)
    return '\n'.join(out)


def is_local(url):
    u = urlsplit(url)
    return not (u.scheme or url.startswith(('//', '#', 'data:', 'mailto:', 'javascript:')))


def check(site, reference=None, warnings=None):
    s = settings()
    nbs = ROOT / (s['nbs_path'] or 'nbs')
    nbl = notebooks(nbs)
    rels = course_order([p.relative_to(nbs).as_posix() for p in nbl])
    pages = {r: page_name(r) for r in rels}
    html_files = sorted(p for p in site.rglob('*.html'))
    soups = {p.relative_to(site).as_posix(): soup(p) for p in html_files}

    # a page per notebook, with title, summary and its plots
    for r in rels:
        nb = json.loads((nbs / r).read_text(encoding='utf-8'))
        title, summary = nb_title_summary(nb)
        pg = pages[r]
        sp = soups.get(pg)
        if sp is None: report(f'page {r}', [f'{pg} is missing']); continue
        art = article(sp)
        h1 = art.find('h1')
        probs = []
        if not h1: probs.append(f'{pg} has no title')
        elif title and norm(h1.get_text()).rstrip('#¶ ').strip() != norm(title.replace('`', '')): probs.append(f'{pg} title is {norm(h1.get_text())!r}, expected {title!r}')
        summ = art.find(class_='nb-summary')
        if summary and (not summ or not norm(summ.get_text())): probs.append(f'{pg} does not show the summary')
        report(f'page {r}', probs)
        want = visible_images(nb)
        got = len([i for i in art.select('div.cell_output img')])
        # at least the notebook's own image outputs (nbdev may add some: it runs cells that import things), each with alt text
        probs = [] if got >= want else [f'{pg} shows {got} output images, the notebook has {want}']
        probs += [f"{pg}: an output image has no alt text but its file name {i.get('alt')!r}" for i in art.select('div.cell_output img')
                  if not i.get('alt') or i.get('alt') == i.get('src') or i.get('alt', '').startswith('_images/')][:1]
        report(f'plots {r}', probs)

    # navigation: every page lists every notebook in course order
    expected = [pages[r] for r in rels]
    probs = []
    for pg in [pages[r] for r in rels if pages[r] in soups]:
        tree = soups[pg].find(class_='sidebar-tree')
        if tree is None: probs.append(f'{pg}: no navigation'); continue
        got = []
        for a in tree.find_all('a', href=True):
            h = a['href']
            tgt = pg if h.startswith('#') else (Path(pg).parent / urlsplit(h).path).as_posix()
            tgt = str(Path(tgt)).replace('\\', '/')
            got.append(re.sub(r'^\./', '', tgt))
        if got != expected:
            miss, extra = [x for x in expected if x not in got], [x for x in got if x not in expected]
            probs.append(f'{pg}: nav ' + (f'lacks {miss} ' if miss else '') + (f'has extra {extra} ' if extra else '')
                         + ('' if miss or extra else f'is out of order: {got}'))
    report('nav', probs)

    # error outputs anywhere
    probs = []
    for pg, sp in soups.items():
        art = article(sp)
        if art.find(class_='system-message') or art.find(class_='problematic'): probs.append(f'{pg}: docutils error message')
        if art.select('.cell_output .traceback, .cell_output .output.error'): probs.append(f'{pg}: error output')
        if 'Traceback (most recent call last)' in art.get_text(): probs.append(f'{pg}: a traceback')
    report('errors', probs)

    # local files referenced
    probs = []
    for pg, sp in soups.items():
        for tag, attr in (('img', 'src'), ('script', 'src'), ('link', 'href'), ('a', 'href'), ('source', 'src')):
            for t in sp.find_all(tag):
                url = t.get(attr)
                if not url or not is_local(url): continue
                path = unquote(urlsplit(url).path)
                if not path: continue
                f = (site / pg).parent / path
                if not f.exists(): probs.append(f'{pg}: {tag} {url} does not exist')
    report('local-files', sorted(set(probs)))

    # anchors: a link to a place in a page (`page.html#name`, `#name`) lands on an element with that id
    probs = []
    ids = {pg: {t['id'] for t in sp.find_all(id=True)} for pg, sp in soups.items()}
    for pg, sp in soups.items():
        for a in article(sp).find_all('a', href=True):
            u = urlsplit(a['href'])
            if not u.fragment or u.scheme or a['href'].startswith('//'): continue
            tgt = posixpath.normpath(posixpath.join(posixpath.dirname(pg), unquote(u.path))) if u.path else pg
            if tgt in ids and unquote(u.fragment) not in ids[tgt]: probs.append(f'{pg}: the link {a["href"]} goes to no anchor of {tgt}')
    report('anchors', sorted(set(probs)))

    # math: local MathJax
    probs = []
    for pg, sp in soups.items():
        if not article(sp).find(class_='math'): continue
        srcs = [t.get('src', '') for t in sp.find_all('script')]
        mj = [x for x in srcs if 'mathjax' in x.lower() or 'tex-mml' in x]
        if not mj: probs.append(f'{pg}: has math but loads no MathJax')
        elif not any(is_local(x) and (site / pg).parent.joinpath(urlsplit(x).path).exists() for x in mj):
            probs.append(f'{pg}: MathJax is not local ({mj[0]}): run the build where npm works')
    report('math', probs)

    # leftover Quarto / nbdev syntax
    probs = []
    pats = [(r'\{target=', 'Quarto link attributes'), (r'output-file:', 'front matter'), (r'^---$', 'front matter'),
            (r':::', 'Quarto div'), (r'\$\$', 'raw display math'), (r'(?<![\w\\])\$[^\s$][^$\n]{0,200}?(?<!\s)\$(?!\w)', 'raw inline math'),
            (r'\{\.[\w-]+\}', 'attribute syntax'), (r'\\[()]', 'raw math delimiters'), (r'\\[a-zA-Z]{2,}', 'raw TeX (a `$$` block inside a paragraph?)')]
    for pg, sp in soups.items():
        art = article(sp)
        for code in art.select('div.cell_input pre'):
            if re.search(r'^\s*#\|', code.get_text(), re.M): probs.append(f'{pg}: a `#|` line is shown in a code cell')
        for code in art.find_all('pre'):
            m = re.search(r'\[`[^`\]]+`\]\([^)\s]+\)', code.get_text())
            if m: probs.append(f'{pg}: a markdown link shown as text in a code block {m.group(0)[:60]!r}')
        text = prose(art)
        for pat, what in pats:
            m = re.search(pat, text, re.M)
            if m: probs.append(f'{pg}: {what} {m.group(0)[:40]!r}')
    report('syntax', probs)

    # layout: the stylesheet widens furo's 46em column and lets wide output tables scroll; every page loads it, and
    # every table in an output sits in a box that scrolls (so its last columns, the results, stay reachable)
    probs = []
    css = site / '_static' / 'nbdev.css'
    if not css.exists(): probs.append('_static/nbdev.css is missing')
    else:
        t = css.read_text(encoding='utf-8')
        if not re.search(r'\.content\s*\{[^}]*max-width', t): probs.append('nbdev.css does not widen the content column (.content { max-width })')
        if not re.search(r'\.output\.text_html[^{]*\{[^}]*overflow-x:\s*auto', t): probs.append('nbdev.css does not let output tables scroll (overflow-x: auto)')
    for pg, sp in soups.items():
        if not any(Path(urlsplit(l.get('href', '')).path).name == 'nbdev.css' for l in sp.find_all('link')): probs.append(f'{pg}: does not load nbdev.css')
        for tb in article(sp).select('div.cell_output table'):
            if not tb.find_parent(class_=['text_html', 'text_markdown', 'table-wrapper']):
                probs.append(f'{pg}: a table in a cell output is not inside a scrolling box')
    report('layout', sorted(set(probs)))

    # results: every `#| results` cell of a notebook is on the index page, under its title, with its figures
    probs, idx = [], soups.get('index.html')
    want = {}
    for r in rels:
        for c in json.loads((nbs / r).read_text(encoding='utf-8'))['cells']:
            src = ''.join(c['source']) if isinstance(c['source'], list) else c['source']
            m = re.search(r'^#\|\s*results:\s*(.+?)\s*$', src, re.M)
            if c['cell_type'] == 'code' and m:
                n = sum(any(k.startswith('image/') for k in o.get('data', {})) for o in c.get('outputs', []))
                want[m.group(1)] = want.get(m.group(1), 0) + n
    if want and idx is None: probs.append('index.html is missing')
    elif want:
        heads = {norm(h.get_text()).rstrip('#¶ ').strip(): h for h in article(idx).find_all('h3')}
        for t, n in want.items():
            if t not in heads: probs.append(f'index.html has no results heading {t!r}'); continue
            sec = heads[t].find_parent('section')
            got = len(sec.select('div.cell_output img')) if sec else 0
            if got < n: probs.append(f'index.html shows {got} figures under {t!r}, its notebook cells have {n}')
    report('results', probs)

    if warnings is not None:
        w = [l for l in Path(warnings).read_text().splitlines() if l.strip()] if Path(warnings).exists() else ['no warnings file']
        report('warnings', w)

    if reference is not None:
        probs = []
        ref = Path(reference)
        if not ref.exists(): probs.append(f'{ref} does not exist: run `make docs`')
        else:
            a = {p.relative_to(site).as_posix() for p in site.rglob('*') if p.is_file() and (p.suffix == '.html' or p.parent.name == '_images')}
            b = {p.relative_to(ref).as_posix() for p in ref.rglob('*') if p.is_file() and (p.suffix == '.html' or p.parent.name == '_images')}
            for x in sorted(a - b): probs.append(f'{x} missing from {ref}')
            for x in sorted(b - a): probs.append(f'{x} in {ref} is no longer built')
            for x in sorted(a & b):
                if not x.endswith('.html') or (site / x).read_bytes() == (ref / x).read_bytes(): continue   # (the build is deterministic)
                sa, sb = article(soups[x]), article(soup(ref / x))
                if norm(sa.get_text()) != norm(sb.get_text()) or [i.get('src') for i in sa.find_all('img')] != [i.get('src') for i in sb.find_all('img')]:
                    probs.append(f'{ref}/{x} is stale')
            if not (ref / '.nojekyll').exists(): probs.append(f'{ref}/.nojekyll is missing')
            if probs: probs.append('run `make docs` and commit docs/ and README.md')
        report('fresh', probs)
    return 1 if any(p for _, p in results) else 0


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('site')
    ap.add_argument('--reference', help='committed site to compare with (staleness)')
    ap.add_argument('--warnings', help='file of Sphinx warnings from the build')
    a = ap.parse_args()
    sys.exit(check(Path(a.site), a.reference, a.warnings))
