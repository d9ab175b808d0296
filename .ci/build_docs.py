#!/usr/bin/env python
"""Build the documentation site (docs/) and README.md from the notebooks, offline.

    python .ci/build_docs.py                    # docs/ and README.md (what `make docs` runs)
    python .ci/build_docs.py --readme-only      # README.md only (`make readme`)
    python .ci/build_docs.py --out DIR --readme FILE   # build elsewhere (CI compares with the committed copies)

nbdev renders its docs with Quarto, which cannot be installed offline. This script keeps nbdev's own
processing (the notebooks nbdev hands to Quarto: `#| hide` cells dropped, `#| export` cells replaced by
`show_doc` API docs, cross-links added) and renders the result with Sphinx + MyST-NB + furo instead,
without executing anything: the committed notebooks carry their outputs.

1. nbdev's pieces, as in `nbdev.quarto._pre_docs` but without `_ensure_quarto` (which would try to install
   Quarto): `refresh_quarto_yml()`, `_build_modidx()`, `nbdev_sidebar`, then `nbdev.serve_drv.main` with nbdev's
   `FilterDefaults` processors on each notebook (what `proc_nbs` runs) -> `_proc/`. One guard is added
   (.ci/docs_procs.py): cells flagged `#| slow` / `#| gpu` are never run while building the docs.
2. A cleaning pass turns Quarto-isms into MyST (see `clean_nb`).
3. Sphinx builds the site into a scratch folder; it is copied to docs/ without build junk, with a local
   MathJax 3 (npm package `mathjax@3`) so math renders with no network.
4. README.md is rendered from the processed index notebook as GitHub-flavoured markdown.
"""
import argparse, copy, html, json, os, posixpath, re, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATHJAX_PKG = 'mathjax@3'
MATHJAX_CACHE = ROOT / '.cache' / 'mathjax'  # git-ignored npm prefix
MATHJAX_FILES = ['tex-mml-chtml.js', 'output/chtml/fonts/woff-v2', 'input/tex/extensions']
COLAB_BADGE = 'https://colab.research.google.com/assets/colab-badge.svg'
# The hidden Colab install cell imports and runs code, which nbdev's docs processor warns about ("Found cells
# containing imports and other code"); it is expected (a no-op outside Colab), so exactly that warning is silenced.
_COLAB_WARNING = 'ignore:Found cells containing imports and other code. See FAQ.\n---\n# In Colab'
NB_KEYS = {'code': {'id', 'cell_type', 'metadata', 'source', 'outputs', 'execution_count'},
           'markdown': {'id', 'cell_type', 'metadata', 'source', 'attachments'},
           'raw': {'id', 'cell_type', 'metadata', 'source', 'attachments'}}


def log(*a): print('[build_docs]', *a, flush=True)


# ---------------------------------------------------------------- 1. nbdev's processing (no Quarto)
def nbdev_process(only=None):
    """nbdev's docs pre-processing, as `nbdev.quarto._pre_docs` does it minus `_ensure_quarto`.
    Returns (config, `_proc` folder, page order from sidebar.yml, {notebook: error})."""
    from nbdev.config import get_config
    from nbdev.quarto import refresh_quarto_yml, nbdev_sidebar
    import nbdev.doclinks
    cfg = get_config()
    nbs = Path(cfg.nbs_path)
    refresh_quarto_yml()                      # nbs/_quarto.yml, nbs/nbdev.yml (kept for `nbdev_docs` with Quarto)
    nbdev.doclinks._build_modidx()            # compressive_tutorial/_modidx.py (cross-links)
    nbdev_sidebar.__wrapped__(path=nbs)       # nbs/sidebar.yml: the page order
    import yaml
    side = yaml.safe_load((nbs / 'sidebar.yml').read_text())
    order = []
    def walk(items):
        for it in items:
            if isinstance(it, str): order.append(it)
            elif isinstance(it, dict):
                if 'href' in it: order.append(it['href'])
                walk(it.get('contents', []))
    walk(side['website']['sidebar']['contents'])
    # `nbdev.serve.proc_nbs` runs `serve_drv.main` on every notebook into _proc/ but stops at the first
    # error; run the same per-notebook step here so that every failing notebook is reported.
    cache = Path(cfg.config_path) / '_proc'
    if cache.exists(): shutil.rmtree(cache)
    cache.mkdir()
    todo = [p for p in order if p.endswith('.ipynb') and (only is None or p in only)]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from docs_procs import DocsFilter     # nbdev's FilterDefaults, but cells flagged slow/gpu are not run
    import nbdev.serve_drv
    import concurrent.futures as cf, multiprocessing as mp
    for p in todo: (cache / p).parent.mkdir(parents=True, exist_ok=True)
    os.environ['PYTHONWARNINGS'] = ','.join(filter(None, [os.environ.get('PYTHONWARNINGS'), _COLAB_WARNING]))  # for the workers
    n = max(1, min(os.cpu_count() or 1, 4, len(todo)))
    errors = {}
    with cf.ProcessPoolExecutor(n, mp_context=mp.get_context('spawn')) as ex:   # spawn, as proc_nbs does
        futs = {p: ex.submit(nbdev.serve_drv.main, (nbs / p, cache / p, DocsFilter)) for p in todo}
        for p, f in futs.items():
            e = f.exception()
            if e is not None:
                tb = str(e.__cause__ or '')   # the worker's traceback: its first "XxxError: ..." line is the root cause
                root = next((l for l in tb.splitlines() if re.match(r'^\w+(Error|Exception|Interrupt|Exit)\b', l)), '')
                cause = f'\n    caused by {root}' if root else ''
                errors[p] = f'{e}{cause}'
    for k, v in errors.items():
        lines = v.splitlines()
        body = [l for l in lines[1:] if not l.startswith('    caused by ')]
        log(f'ERROR: nbdev could not process nbs/{k} for the docs: {lines[0]}')
        for l in body[:6] + (['...'] if len(body) > 6 else []) + [l for l in lines if l.startswith('    caused by ')]:
            log('    ' + l.rstrip())
        log('  Hint: to render show_doc, nbdev runs the exported cells and every cell that contains an import '
            '(anywhere in the cell, even inside a with-block or a function), and no other cell; such a cell then '
            'runs without the cells before it. Move the import into a cell of its own (e.g. the import cell at the top).')
    copy_assets(nbs, cache)  # images etc. that notebooks link to
    return cfg, cache, [p for p in order if p.endswith('.ipynb')], errors


def copy_assets(nbs:Path, dest:Path):
    "Copy the non-notebook files of nbs/ (images a notebook links to, ...) to `dest`, keeping their relative paths."
    for f in nbs.rglob('*'):
        rel = f.relative_to(nbs)
        if f.is_dir() or f.suffix == '.ipynb' or any(x.startswith(('.', '_')) for x in rel.parts): continue
        if rel.as_posix() in ('nbdev.yml', 'sidebar.yml', 'styles.css'): continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest / rel)


# ---------------------------------------------------------------- 2. cleaning pass
_re_fm = re.compile(r'^---\s*\n(.*?)\n---\s*$', re.S)
_re_quarto_attr_link = re.compile(r'\[([^\]]*)\]\(([^)\s]+)\)\{([^}]*)\}')
_re_md_link = re.compile(r'(\]\()([^)\s]+)(\))')
_re_directive = re.compile(r'^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$')


def src_of(c): return c['source'] if isinstance(c['source'], str) else ''.join(c['source'])


def split_directives(src):
    "Leading `#| key: value` lines of a code cell -> ({key: value}, rest of the source)."
    lines, d = src.split('\n'), {}
    i = 0
    while i < len(lines):
        m = _re_directive.match(lines[i])
        if m and lines[i].lstrip().startswith('#|'):
            d[m.group(1)] = m.group(2).strip('"\'')
            i += 1
        elif not lines[i].strip() and d: i += 1
        else: break
    return d, '\n'.join(lines[i:])


_re_doc_link = re.compile(r'\[(`[^`\]]+`)\]\(([^)\s]+)\)')   # nbdev's link to a symbol: [`name`](url)


def showdoc_anchors(procs, pages):
    "{page: the anchors of its show_doc entries}: the symbols nbdev documents there (its links use `name.lower()`)."
    out = {}
    for p, nb in procs.items():
        ids = out.setdefault(pages[p], set())
        for c in nb['cells']:
            for o in c.get('outputs', []):
                t = src_of({'source': o.get('data', {}).get('text/markdown', '')})
                m = re.search(r'^#{2,6}\s+(.+?)\s*$', t, re.M)
                if m and t.lstrip().startswith('---'): ids.add(m.group(1).strip().strip('`').lower())
    return out


class Linker:
    "Rewrites links: doc-host URLs and notebook names -> relative page links (docs) or repo paths (README)."
    def __init__(self, cfg, pages, docs=True, anchors=None):
        self.host = (cfg.doc_host.rstrip('/') + '/' + cfg.doc_baseurl.strip('/')).rstrip('/') + '/'
        self.pages, self.docs = pages, docs    # pages: 'nbs-relative notebook path' -> 'page.html'
        self.anchors = anchors                 # {page: show_doc anchors}, from `showdoc_anchors` (None: links kept as they are)
        self.nb_by_name = {Path(k).name: k for k in pages}
        self.nbs_dir = Path(cfg.nbs_path).name + '/'   # README links point into the repository

    def fix(self, url, here):
        "`url` as seen from the page `here` (a path like 'demo.html')."
        frag = ''
        if '#' in url: url, frag = url.split('#', 1); frag = '#' + frag
        if url.startswith(self.host):
            if not self.docs: return url + frag                      # README: keep the absolute doc link
            target = url[len(self.host):] or 'index.html'
        elif url.endswith('.ipynb') and '://' not in url:
            key = posixpath.normpath(posixpath.join(posixpath.dirname(self.here_nb), url))
            key = key if key in self.pages else self.nb_by_name.get(Path(url).name)
            if key is None: return url + frag
            if not self.docs: return self.nbs_dir + key + frag
            target = self.pages[key]
        else: return url + frag
        return posixpath.relpath(target, posixpath.dirname(here) or '.') + frag

    def symbol(self, m):
        "nbdev links a name in backticks to `page.html#name` whenever the name is in the index, also where the page has no entry for it (a method documented with its class, a private helper): link to the entry, else to its class's entry, else not at all."
        name, url = m.group(1), m.group(2)
        if self.anchors is None or not url.startswith(self.host) or '#' not in url: return m.group(0)
        base, frag = url.split('#', 1)
        ids = self.anchors.get(base[len(self.host):] or 'index.html')
        if ids is None: return m.group(0)                      # a page not built this time (`--readme-only`)
        while frag not in ids and '.' in frag: frag = frag.rsplit('.', 1)[0]
        return f'[{name}]({base}#{frag})' if frag in ids else name

    def md(self, text, here, here_nb):
        self.here_nb = here_nb
        text = _re_doc_link.sub(self.symbol, text)
        return _re_md_link.sub(lambda m: m.group(1) + self.fix(m.group(2), here) + m.group(3), text)


def clean_showdoc_md(md, linker, here, here_nb):
    "show_doc markdown: drop the leading `---`, turn Quarto's `{target=...}` source link into HTML, add nbdev's anchor."
    md = re.sub(r'^\s*---\s*\n', '', md)
    m = re.search(r'^#{2,6}\s+(.+?)\s*$', md, re.M)
    # nbdev links to `page.html#name.lower()` (Quarto's heading id); Sphinx's id for the heading differs for
    # names like `Block.forward` (-> `block-forward`), so add nbdev's id where it differs.
    anchor = ''
    if m:
        from docutils.nodes import make_id
        name = m.group(1).strip().strip('`')
        if make_id(name) != name.lower(): anchor = f'<span id="{html.escape(name.lower())}"></span>'
    def src_link(mm):
        return f'<a href="{html.escape(mm.group(2))}" class="nbdev-source-link">{mm.group(1)}</a>{anchor}'
    md, n = _re_quarto_attr_link.subn(src_link, md, count=1)
    if not n and anchor: md = anchor + '\n\n' + md
    # the signature is a code block: nbdev's links in its parameter comments would show as markdown text there, so keep
    # the names as written; and a parameter whose default is None reads `device=None` as in the code, not `device:NoneType=None`
    md = re.sub(r'```python\n.*?```', lambda f: _re_doc_link.sub(r'\1', f.group(0)).replace(':NoneType=None', '=None'), md, flags=re.S)
    return linker.md(md, here, here_nb)


def clean_nb(nb, page, nb_rel, linker):
    "Make one nbdev-processed notebook valid nbformat that MyST-NB renders as nbdev intends."
    cells, meta, section = [], {}, None
    for i, c in enumerate(nb['cells']):
        c = {k: v for k, v in c.items() if k in NB_KEYS.get(c['cell_type'], NB_KEYS['raw'])}  # drops has_sd etc.
        c.setdefault('metadata', {})
        src = src_of(c)
        if c['cell_type'] == 'raw':
            m = _re_fm.match(src.strip())
            if i == 0 and m:                          # Quarto front matter -> heading + summary
                import yaml
                meta = yaml.safe_load(m.group(1)) or {}
                md = f"# {meta.get('title', Path(page).stem)}"
                if meta.get('description'): md += '\n\n{.nb-summary}\n' + str(meta['description'])
                cells.append({'cell_type': 'markdown', 'metadata': {}, 'source': md})
            continue                                  # other raw cells are Quarto-only
        if c['cell_type'] == 'markdown':
            if src.strip().startswith('<!-- WARNING: THIS FILE WAS AUTOGENERATED'): continue
            heads = re.findall(r'^#{1,6}\s+(.+?)\s*$', src, re.M)
            if heads: section = re.sub(r'[*`$\\]', '', heads[-1])
            src = _re_quarto_attr_link.sub(r'[\1](\2)', src)
            src = linker.md(src, page, nb_rel)
            if linker.docs:   # the badge image from the site itself, so pages look right offline
                src = src.replace(COLAB_BADGE, posixpath.relpath('_static/colab-badge.svg', posixpath.dirname(page) or '.'))
            c['source'] = src
            cells.append(c); continue
        # code cell: Quarto cell options -> MyST-NB tags; the `#|` lines are not shown (as in Quarto)
        d, body = split_directives(src)
        tags = set(c['metadata'].get('tags', []))
        if d.get('echo', '').lower() == 'false': tags.add('remove-input')
        if d.get('output', '').lower() == 'false': tags.add('remove-output')
        if d.get('include', '').lower() == 'false': tags.add('remove-cell')
        is_sd = re.match(r'\s*show_doc\b', body) is not None
        if is_sd: tags.add('nbdev-showdoc')
        if 'code-summary' in d: tags.add('nbdev-exported-source')
        c['source'] = body
        for o in c.get('outputs', []):
            data = o.get('data', {})
            if 'text/markdown' in data:
                t = src_of({'source': data['text/markdown']})
                data['text/markdown'] = clean_showdoc_md(t, linker, page, nb_rel) if is_sd else linker.md(t, page, nb_rel)
        if tags: c['metadata']['tags'] = sorted(tags)
        if any(k.startswith('image/') for o in c.get('outputs', []) for k in o.get('data', {})):   # alt text for its figures:
            alt = d.get('fig-alt') or d.get('fig-cap') or d.get('results') or (section and f'Figure of the section "{section}"')   # Quarto's
            if alt: c['metadata']['mystnb'] = {'image': {'alt': alt}}                                            # options first
        cells.append(c)
    for j, c in enumerate(cells): c.setdefault('id', f'cell-{j}')
    out = copy.deepcopy(nb)
    out['cells'] = cells
    out['metadata'] = {k: v for k, v in nb.get('metadata', {}).items() if k in ('kernelspec', 'language_info')}
    out['metadata'].setdefault('kernelspec', {'display_name': 'python3', 'language': 'python', 'name': 'python3'})
    return out, meta


# ---------------------------------------------------------------- 2b. the index's results section
# A code cell whose directives include `#| results: TITLE` holds a headline result of its notebook (a table, a
# figure): its saved outputs are copied, never retyped, into the index page where a markdown cell holds the marker
# below, in course order, with the notebook's hardware line (found in its saved outputs) and the date its outputs
# were committed.
RESULTS_MARKER = '<!-- results -->'
_re_hardware = re.compile(r'(CPU [^|\n]*?torch \d[\w.+]*|[^|\n:]*\(CUDA[^)\n]*\)[^|\n]*?torch \d[\w.+]*)')   # hardware()'s line


def outputs_date(nb_path, ids):
    "The day the outputs of a notebook's cells `ids` were last changed by a commit (today, UTC, if uncommitted changes touch them): an edit of its prose, or of another cell's output, keeps the date."
    def git(*a): return subprocess.run(['git', *a], cwd=ROOT, capture_output=True, text=True).stdout
    def outputs(text):                                   # those cells' outputs, by id; None: no notebook there
        try: return [(c.get('id'), c.get('outputs')) for c in json.loads(text)['cells'] if c.get('id') in ids]
        except ValueError: return None
    import datetime
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    rel = Path(nb_path).resolve().relative_to(ROOT).as_posix()
    if outputs(Path(nb_path).read_text()) != outputs(git('show', f'HEAD:{rel}')): return today
    for line in git('log', '--format=%H %cs', '--', rel).splitlines():   # newest first, each against its first parent
        sha, day = line.split()
        if outputs(git('show', f'{sha}:{rel}')) != outputs(git('show', f'{sha}^:{rel}')): return day   # (with merges, not the next line's)
    return today


def headline_outputs(c):
    "What a results cell shows: its figures, tables and markdown, and its last stdout (earlier ones are progress)."
    outs = [o for o in c.get('outputs', []) if o['output_type'] in ('execute_result', 'display_data')]
    streams = [o for o in c.get('outputs', []) if o['output_type'] == 'stream' and o.get('name') == 'stdout']
    keep = outs + streams[-1:]
    return [o for o in c.get('outputs', []) if any(o is k for k in keep)]


def results_cells(nbs, nbs_dir):
    "Index cells for every `#| results` cell of the notebooks `nbs` ({path under nbs/: notebook}), in course order."
    cells = []
    for p, nb in nbs.items():
        picked = []
        for c in nb['cells']:
            if c['cell_type'] != 'code': continue
            d, _ = split_directives(src_of(c))
            if 'results' in d and c.get('outputs'): picked.append((d['results'] or Path(p).stem, c))
        if not picked: continue
        title = None
        for t, c in picked:
            if t != title:
                title, hw = t, None
                for prev in reversed(nb['cells'][:nb['cells'].index(c) + 1]):   # the run's own line: nearest at or before
                    for o in prev.get('outputs', []):
                        text = src_of({'source': o.get('text', '')}) + src_of({'source': o.get('data', {}).get('text/plain', '')})
                        hw = hw or _re_hardware.search(text)
                    if hw: break
                if hw is None: sys.exit(f'build_docs: nbs/{p} has a `#| results` cell ({t}) with no hardware line in '
                                        'its outputs or before it (print `compressive_tutorial.train.hardware()` beside the run)')
                cells.append({'cell_type': 'markdown', 'metadata': {}, 'source':
                              f'### {t}\n\nFrom [{Path(p).stem}]({Path(p).name}), run on {hw.group(1).strip()}; '
                              f'outputs committed {outputs_date(nbs_dir / p, {c2.get("id") for t2, c2 in picked if t2 == t})}.'})
            cells.append({'cell_type': 'code', 'metadata': {'tags': ['remove-input']}, 'execution_count': None,
                          'source': f'# saved outputs of a cell of {p}', 'outputs': copy.deepcopy(headline_outputs(c))})
    return cells


def add_results(index_nb, cells):
    "Replace the index's marker cell by `cells` (the marker's own text, minus the marker, stays above them)."
    out = []
    for c in index_nb['cells']:
        if c['cell_type'] == 'markdown' and RESULTS_MARKER in src_of(c):
            rest = src_of(c).replace(RESULTS_MARKER, '').strip()
            if rest: out.append({**c, 'source': rest})
            out.extend(copy.deepcopy(cells))
        else: out.append(c)
    index_nb['cells'] = out
    return index_nb


# ---------------------------------------------------------------- 3. Sphinx
CONF = '''# Generated by .ci/build_docs.py
project = {title!r}
author = {author!r}
copyright = {copyright!r}
html_title = {title!r}
extensions = ["myst_nb"]
nb_execution_mode = "off"              # the committed notebooks carry their outputs
nb_render_markdown_format = "myst"     # show_doc tables and math inside outputs
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "attrs_block", "attrs_inline"]
myst_all_links_external = True         # links were already rewritten to relative page links
myst_heading_anchors = 0
html_theme = "furo"
html_static_path = ["_static"]
html_css_files = ["nbdev.css"]
html_copy_source = False
html_show_sourcelink = False
html_show_sphinx = False
html_last_updated_fmt = None
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]
{mathjax}
html_theme_options = {{
    "navigation_with_keys": True,
}}
'''

CSS = '''/* Generated by .ci/build_docs.py: nbdev's look for show_doc blocks in furo */
.nb-summary { font-size: 1.15em; color: var(--color-foreground-secondary); margin-top: -0.5em; }
.tag_nbdev-showdoc { border-top: 1px solid var(--color-background-border); padding-top: 0.6em; margin-top: 1.2em; }
.tag_nbdev-showdoc .cell_output h3, .tag_nbdev-showdoc .cell_output h4 { margin-top: 0.2em; }
a.nbdev-source-link { float: right; font-size: smaller; }
.tag_nbdev-showdoc .cell_output .output.text_markdown > p:first-child { margin: 0; }
.tag_nbdev-exported-source .cell_input { border-left: 3px solid var(--color-brand-primary); }
div.cell_output table { border-collapse: collapse; margin: 0.5em 0; }
div.cell_output table th, div.cell_output table td { border: 1px solid var(--color-background-border); padding: 0.2em 0.6em; }
/* Layout: furo's content column is 46em (~740 px), which cuts notebook code lines (up to ~130 characters) and
   pushes the result columns of wide tables off the page. With the navigation beside it (>= 63em), the column
   takes the width there is, up to 74em, and code is set at 12 px: at 1280 px a 130-character line fits. */
@media (min-width: 63em) {
  .sidebar-drawer { width: calc(50% - 37em); }
  .main { min-width: 0; }
  .content { width: auto; flex: 1 1 0; min-width: 0; max-width: 74em; padding: 0 1.5em; }
}
div.cell_input pre, div.cell_output pre, .tag_nbdev-showdoc pre { font-size: 12px; }
/* Wide tables scroll sideways inside the column (the output area, or furo's .table-wrapper for markdown tables),
   never off the page; compact cells keep the result columns in view as often as possible. */
div.cell_output .output.text_html, div.cell_output .output.text_markdown { overflow-x: auto; max-width: 100%; }
div.cell_output table { font-size: 0.85em; }
div.cell_output table th, div.cell_output table td { padding: 0.15em 0.5em; }
'''

BADGE = '''<svg xmlns="http://www.w3.org/2000/svg" width="117" height="20" role="img" aria-label="Open In Colab">
<title>Open In Colab</title>
<rect rx="3" width="117" height="20" fill="#555"/><rect rx="3" x="60" width="57" height="20" fill="#f9ab00"/>
<rect x="60" width="4" height="20" fill="#f9ab00"/>
<g fill="#fff" text-anchor="middle" font-family="Verdana,DejaVu Sans,sans-serif" font-size="11">
<text x="30" y="14">Open In</text><text x="88" y="14">Colab</text></g></svg>
'''


def get_mathjax():
    "Folder of MathJax 3's es5 build, installed with npm into a git-ignored cache; None if npm is unavailable."
    es5 = MATHJAX_CACHE / 'node_modules' / 'mathjax' / 'es5'
    if (es5 / 'tex-mml-chtml.js').exists(): return es5
    npm = shutil.which('npm')
    if not npm:
        log('WARNING: npm not found: math will load MathJax from a CDN when the pages are viewed')
        return None
    MATHJAX_CACHE.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([npm, 'install', '--no-save', '--no-audit', '--no-fund', '--prefix', str(MATHJAX_CACHE), MATHJAX_PKG],
                       capture_output=True, text=True)
    if r.returncode or not (es5 / 'tex-mml-chtml.js').exists():
        log('WARNING: `npm install mathjax@3` failed: math will load MathJax from a CDN when the pages are viewed\n' + r.stderr[-2000:])
        return None
    return es5


def sphinx_build(src, out, doctrees):
    from sphinx.cmd.build import build_main
    warnfile = src.parent / 'sphinx-warnings.txt'
    rc = build_main(['-b', 'html', '-q', '-E', '-j', '1', '-d', str(doctrees), '-w', str(warnfile), str(src), str(out)])
    warns = [l for l in warnfile.read_text().splitlines() if l.strip()] if warnfile.exists() else []
    return rc, warns


def copy_site(html_dir, dest):
    "Copy the built site to `dest` without build junk."
    junk = shutil.ignore_patterns('.doctrees', '_sources', '.buildinfo', '.buildinfo.bak', '__pycache__')
    if dest.exists(): shutil.rmtree(dest)
    shutil.copytree(html_dir, dest, ignore=junk)
    (dest / '.nojekyll').write_text('')


# ---------------------------------------------------------------- 4. README
def to_gfm(nb, linker, nb_rel):
    "A cleaned index notebook -> GitHub-flavoured markdown."
    parts = []
    for c in nb['cells']:
        src = src_of(c).strip()
        tags = c.get('metadata', {}).get('tags', [])
        if 'remove-cell' in tags: continue
        if c['cell_type'] == 'markdown':
            if src.startswith('```{toctree}'): continue
            src = re.sub(r'^\{\.nb-summary\}\n(.*)$', r'> \1', src, flags=re.M | re.S)
            parts.append(linker.md(src, 'README.md', nb_rel))
            continue
        if src and 'remove-input' not in tags: parts.append('```python\n' + src + '\n```')
        if 'remove-output' in tags: continue
        for o in c.get('outputs', []):
            if o['output_type'] == 'stream': parts.append('```\n' + src_of({'source': o['text']}).rstrip('\n') + '\n```')
            elif o['output_type'] in ('execute_result', 'display_data'):
                d = o.get('data', {})
                if 'text/markdown' in d: parts.append(src_of({'source': d['text/markdown']}).strip())
                elif any(k.startswith('image/') for k in d): continue   # images: see the docs site
                elif 'text/plain' in d: parts.append('```\n' + src_of({'source': d['text/plain']}).rstrip('\n') + '\n```')
    body = '\n\n'.join(parts) + '\n'
    note = '<!-- Generated from nbs/index.ipynb by `make docs` (.ci/build_docs.py); edit the notebook, not this file. -->\n\n'
    return note + body


# ---------------------------------------------------------------- main
def build(out=None, readme=None, readme_only=False, keep_going=False):
    os.chdir(ROOT)
    from nbdev.config import get_config
    readme_nb = get_config().get('readme_nb', 'index.ipynb')
    cfg, cache, order, errors = nbdev_process(only=[readme_nb] if readme_only else None)
    from nbdev.doclinks import _nbpath2html
    all_nbs = [p for p in order if p.endswith('.ipynb')]
    pages = {p: _nbpath2html(Path(p)).as_posix() for p in all_nbs}
    dup = {v for v in pages.values() if list(pages.values()).count(v) > 1}
    if dup: sys.exit(f'build_docs: two notebooks render to the same page {sorted(dup)}: rename one of them')
    nbs_rel = [p for p in all_nbs if p not in errors and (cache / p).exists()]
    procs = {p: json.loads((cache / p).read_text(encoding='utf-8')) for p in nbs_rel}
    anchors = showdoc_anchors(procs, pages)
    linker = Linker(cfg, pages, anchors=anchors)
    src = cache / '_sphinx'
    (src / '_static').mkdir(parents=True)
    cleaned = {}
    nbs_dir = Path(cfg.nbs_path)
    results = results_cells({p: json.loads((nbs_dir / p).read_text(encoding='utf-8')) for p in all_nbs if p != readme_nb},
                            nbs_dir)   # from the committed notebooks, so that `--readme-only` finds them too
    if readme_nb in procs: add_results(procs[readme_nb], results)
    for p in nbs_rel:
        nb = copy.deepcopy(procs[p])    # clean_nb edits outputs in place; the README cleans the index again
        page = pages[p]
        out_nb, _ = clean_nb(nb, page, p, linker)
        cleaned[p] = out_nb
        dst = src / Path(page).with_suffix('.ipynb')
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(json.dumps(out_nb, indent=1, ensure_ascii=False), encoding='utf-8')

    if readme_nb in cleaned:
        rnb, _ = clean_nb(procs[readme_nb], 'README.md', readme_nb, Linker(cfg, pages, docs=False, anchors=anchors))
        md = to_gfm(rnb, Linker(cfg, pages, docs=False, anchors=anchors), readme_nb)
        rp = Path(readme) if readme else ROOT / 'README.md'
        rp.write_text(md, encoding='utf-8')
        log(f'wrote {rp}')
    else: log(f'ERROR: nbs/{readme_nb} could not be processed: README.md not written')
    if readme_only: return 1 if errors or readme_nb not in cleaned else 0

    copy_assets(Path(cfg.nbs_path), src)  # images etc. that notebooks link to

    # the navigation: index first, then every notebook in sidebar.yml order
    if 'index.ipynb' not in cleaned: sys.exit('build_docs: nbs/index.ipynb is missing or failed (it is the home page and the README)')
    entries = ['self'] + [str(Path(pages[p]).with_suffix('')) for p in nbs_rel if p != 'index.ipynb']
    idx = src / 'index.ipynb'
    nb = json.loads(idx.read_text())
    nb['cells'].append({'cell_type': 'markdown', 'metadata': {}, 'id': 'nbdev-toctree',
                        'source': '```{toctree}\n:hidden:\n:maxdepth: 1\n\n' + '\n'.join(entries) + '\n```'})
    idx.write_text(json.dumps(nb, indent=1, ensure_ascii=False))

    es5 = get_mathjax()
    mathjax = ''
    if es5:
        mj = src / '_static' / 'mathjax'
        for f in MATHJAX_FILES:
            s = es5 / f
            if s.is_dir(): shutil.copytree(s, mj / f)
            else: (mj / f).parent.mkdir(parents=True, exist_ok=True); shutil.copy2(s, mj / f)
        lic = es5.parent / 'LICENSE'
        if lic.exists(): shutil.copy2(lic, mj / 'LICENSE')
        mathjax = 'mathjax_path = "mathjax/tex-mml-chtml.js"   # local MathJax 3 (npm mathjax@3), relative to _static'
    (src / '_static' / 'nbdev.css').write_text(CSS)
    (src / '_static' / 'colab-badge.svg').write_text(BADGE)
    (src / 'conf.py').write_text(CONF.format(title=cfg.get('title', cfg.lib_name), author=cfg.author,
                                             copyright=cfg.copyright, mathjax=mathjax))
    build_dir = cache / '_build'
    log(f'sphinx: {len(nbs_rel)} pages')
    rc, warns = sphinx_build(src, build_dir / 'html', build_dir / 'doctrees')
    for w in warns: print('[sphinx]', w)
    (cache / 'sphinx-warnings.txt').write_text('\n'.join(warns) + ('\n' if warns else ''))
    if rc: sys.exit(f'build_docs: sphinx failed with exit code {rc}')
    dest = Path(out) if out else ROOT / Path(cfg.doc_path).name
    if errors and not out and not keep_going:
        sys.exit(f'build_docs: {len(errors)} notebook(s) failed ({", ".join(errors)}): {dest} left as it was')
    copy_site(build_dir / 'html', dest)
    log(f'wrote {dest} ({len(nbs_rel)} pages, {len(warns)} sphinx warnings)')
    if errors:
        log(f'ERROR: {len(errors)} notebook(s) could not be processed and have no page: {", ".join(errors)}')
        return 1
    return 0


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--out', help='site folder (default: doc_path of settings.ini, i.e. docs/)')
    ap.add_argument('--readme', help='README file to write (default: README.md)')
    ap.add_argument('--readme-only', action='store_true', help='only regenerate README.md')
    ap.add_argument('--keep-going', action='store_true',
                    help='write docs/ even when some notebooks fail (their pages are missing; the exit status is still 1)')
    a = ap.parse_args()
    sys.exit(build(a.out, a.readme, a.readme_only, a.keep_going))
