#!/usr/bin/env python
"""Check that every notebook can run in Colab, where there is no ../shared folder (issue 11).

    python .ci/check_colab.py              # one PASS:/FAIL: line per notebook and check; exit 1 if any failed
    python .ci/check_colab.py NB.ipynb     # only these notebooks

For each notebook nbdev sees (the same list as check_notebooks.py), two checks:

  imports  every module its code imports is in the standard library, comes with Colab (COLAB below), is the package
           itself, or is brought by the notebook's install cell: the package's requirements plus the extras the cell
           names (`compressive-tutorial[experiments] @ git+...`), read from settings.ini, and any package it names.
  data     its data path works without ../shared. In a fresh Python started in a scratch folder outside the
           repository, with `CT_CACHE_DIR` a new empty folder, `find_shared_data` failing as it does in Colab, and the
           network replaced by local fixtures (`urllib.request.urlopen` serves the books at their public URLs from
           the shared copy, and a small fake Enwik8 at its URL, sized and checksummed as the real one is checked),
           it runs, in order, every top-level statement of the notebook that calls a data loader (LOADERS below),
           with the notebook's imports and the literal assignments before them. Statements that need other names the
           notebook computes (tests on scratch folders, fixtures) are skipped: they do not touch ../shared. Slow and
           GPU cells are included: their data path is the one a Colab user runs.

Three fixtures replace more than the network: the Bible's dump (a Linux program from a Debian package, run by
`fetch_books`) is replaced by a copy of the shared dump, since notebook 00 tests that path with fake packages;
Enwik8's expected size and md5 are those of the fake; and LJ Speech's archive holds the 385 shared clips (in the
official archive's layout), so its expected sha256, clip count and duration are the fixture's (the check that the
held clips carry the course's samples is the real one).
"""
import ast, functools, hashlib, io, json, os, re, subprocess, sys, tempfile, time, zipfile
from configparser import ConfigParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / '.ci'))
from check_notebooks import notebooks, settings, src  # noqa: E402

# Modules a Colab GPU runtime has before anything is installed (the ones the course may rely on).
COLAB = {'torch', 'torchvision', 'torchaudio', 'numpy', 'scipy', 'pandas', 'matplotlib', 'IPython', 'ipykernel', 'google', 'tqdm',
         'PIL', 'requests'}
# Functions that read the course's data: a top-level call to one of these is a notebook's data path.
LOADERS = {'find_shared_data', 'books_folder', 'fetch_books', 'load_books', 'books_corpora', 'load_corpus',
           'load_enwik8', 'get_enwik8', 'ljspeech_folder', 'get_ljspeech', 'load_ljspeech'}
PACKAGE = 'compressive_tutorial'
TIMEOUT = 300                    # seconds one notebook's data path may take


# ------------------------------------------------------------------------------------------------ imports
def requirements():
    "{None: base requirement names, extra: names} from settings.ini."
    c = ConfigParser(delimiters=['=']); c.read(ROOT / 'settings.ini', encoding='utf-8')
    d = c['DEFAULT']
    names = lambda s: {re.split(r'[<>=!~\[; ]', r, 1)[0].lower() for r in (s or '').split()}
    out = {None: names(d.get('requirements'))}
    for k in d:
        if k.endswith('_requirements'): out[k[:-len('_requirements')]] = names(d.get(k))
    return out


@functools.lru_cache(maxsize=1)
def _installed() -> dict:
    "{distribution name: top-level modules} of what is installed here."
    from importlib.metadata import packages_distributions
    out = {}
    for m, ds in packages_distributions().items():
        for d in ds: out.setdefault(d.lower().replace('_', '-'), set()).add(m)
    return out


def module_names(dist:str) -> set:
    "The top-level modules a distribution provides (from its installed metadata, else its name)."
    mods = _installed().get(dist.lower().replace('_', '-'), set())
    return mods or {dist.replace('-', '_')}


def install_packages(cells) -> tuple:
    "(names of distributions the Colab install cell brings, problem or None)."
    cell = next((c for c in cells if c['cell_type'] == 'code' and 'google.colab' in src(c)), None)
    if cell is None: return set(), 'no Colab install cell'
    args = [n.value for n in ast.walk(ast.parse(src(cell))) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if 'install' not in args: return set(), 'the install cell does not run pip install'
    reqs, got, brings_package = requirements(), set(), False
    for a in args[args.index('install') + 1:]:
        if a.startswith('-') or a in ('pip', 'install'): continue
        m = re.match(r'^(?:([\w.-]+)(?:\[([\w,\s-]+)\])?\s*@\s*)?git\+https://github\.com/[^/]+/([\w.-]+)', a)
        if m:                                                   # the package from GitHub, maybe with extras
            brings_package = True
            got |= reqs[None]
            for e in (m[2] or '').split(','):
                if e.strip(): got |= reqs.get(e.strip(), set())
        else: got.add(re.split(r'[<>=!~\[; ]', a, 1)[0].lower())
    return got, None if brings_package else 'the install cell does not install the package from GitHub'


def imported_modules(cells) -> dict:
    "{top-level module: first line importing it} over the notebook's code cells."
    out = {}
    for c in cells:
        if c['cell_type'] != 'code': continue
        try: tree = ast.parse(strip_magics(src(c)))
        except SyntaxError: continue
        for n in ast.walk(tree):
            mods = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                   [n.module] if isinstance(n, ast.ImportFrom) and n.module and not n.level else []
            for m in mods: out.setdefault(m.split('.')[0], ast.unparse(n))
    return out


def strip_magics(s:str) -> str: return '\n'.join('' if l.lstrip().startswith(('%', '!')) else l for l in s.splitlines())


def check_imports(cells) -> str|None:
    have, prob = install_packages(cells)
    if prob: return prob
    brought = set().union(*(module_names(d) for d in have)) if have else set()
    missing = [f'{m} ({line})' for m, line in imported_modules(cells).items()
               if m not in sys.stdlib_module_names and m not in COLAB and m != PACKAGE and m not in brought]
    return (f"imports what its install cell does not bring: {', '.join(missing)}; install the package with the extra "
            "that has it (`compressive-tutorial[extra] @ git+...`) or name the package in the install cell") if missing else None


# ------------------------------------------------------------------------------------------------ data
def default_exp(cells) -> str|None:
    for c in cells:
        m = re.search(r'^#\|\s*default_exp\s+(\S+)', src(c), re.M)
        if m: return m[1]
    return None


def data_program(cells) -> tuple:
    "(import statements, [(cell index, statement)] of the data path) of a notebook, as source text."
    imports, steps = [], []
    for i, c in enumerate(cells):
        if c['cell_type'] != 'code' or 'google.colab' in src(c): continue
        s = src(c)
        if re.search(r'^#\|\s*export', s, re.M) and not re.search(r'^\s*(import|from)\s', strip_magics(s), re.M): continue
        try: tree = ast.parse(strip_magics(s))
        except SyntaxError: continue
        for st in tree.body:
            if isinstance(st, (ast.Import, ast.ImportFrom)): imports.append(ast.unparse(st)); continue
            if isinstance(st, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)): continue
            calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(st)
                     if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
            literal = isinstance(st, ast.Assign) and all(isinstance(t, ast.Name) for t in st.targets) and _is_literal(st.value)
            if literal or calls & LOADERS: steps.append((i, ast.unparse(st), bool(calls & LOADERS)))
    return imports, steps


def _is_literal(node) -> bool:
    try: ast.literal_eval(node); return True
    except Exception: return False


def free_names(code:str) -> set:
    "Names a statement reads that it does not bind itself (a conservative approximation)."
    tree = ast.parse(code)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Lambda, ast.FunctionDef)): bound |= {a.arg for a in n.args.args + n.args.kwonlyargs}
        if isinstance(n, ast.ExceptHandler) and n.name: bound.add(n.name)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def make_fixtures(folder:Path, shared_books:Path) -> Path:
    "Local files for the URLs the data path downloads (see the module docstring); returns the manifest's path."
    import compressive_tutorial.data as D
    served, zips = {}, {}
    for r in D.BOOKS_SOURCES:
        s = D.book_source(r)
        if s['kind'] == 'file': served[s['url']] = str(shared_books / r[0])
        elif s['kind'] == 'zip': zips.setdefault(s['url'], []).append((s['member'], shared_books / r[0]))
    for url, members in zips.items():
        z = folder / f'books{len(served)}.zip'
        with zipfile.ZipFile(z, 'w') as zf:
            for member, path in members: zf.write(path, member)
        served[url] = str(z)
    bible = [str(shared_books / r[0]) for r in D.BOOKS_SOURCES if D.book_source(r)['kind'] == 'debian']
    fake = (b'<page><title>check_colab</title><text>' + b'the fake Enwik8 of check_colab ' * 3_300_000)[:D.ENWIK8_SIZE]
    z = folder / 'enwik8.zip'                                   # the real size, so the 90M/5M/5M split runs as in Colab
    with zipfile.ZipFile(z, 'w', compression=zipfile.ZIP_DEFLATED) as zf: zf.writestr('enwik8', fake)
    served[D.ENWIK8_URL] = str(z)
    lj, speech = shared_books.parent / 'speech' / 'ljspeech', {}   # LJ Speech: an archive of the shared clips, in its layout
    if lj.is_dir():
        import tarfile, soundfile as sf
        from compressive_tutorial import speech as SP
        clips = SP.ljspeech_clips(lj)
        a = folder / 'LJSpeech-1.1.tar.bz2'
        with tarfile.open(a, 'w:bz2', compresslevel=1) as tf:
            tf.add(lj / 'metadata.csv', 'LJSpeech-1.1/metadata.csv')
            for i, path in clips: tf.add(path, f'LJSpeech-1.1/{path.parent.name}/{path.name}')
        served[SP.LJSPEECH_URL] = str(a)
        speech = dict(sha256=SP.sha256_file(a), n_clips=len(clips),
                      seconds=sum(sf.info(str(path)).frames for _, path in clips) / SP.SAMPLE_RATE)
    manifest = folder / 'manifest.json'
    manifest.write_text(json.dumps(dict(served=served, bible=bible[0], enwik8_size=len(fake), enwik8_md5=hashlib.md5(fake).hexdigest(),
                                        ljspeech=speech)))
    return manifest


def set_defaults(f, **values):
    "Change the default values of some of `f`'s arguments, positional-or-keyword (`__defaults__`) or keyword-only (`__kwdefaults__`)."
    code = f.__code__
    names = code.co_varnames[:code.co_argcount]
    defaults = list(f.__defaults__ or ()); first = len(names) - len(defaults)
    kw = dict(f.__kwdefaults__ or {})
    for k, v in values.items():
        if k in kw: kw[k] = v
        elif k in names and names.index(k) >= first: defaults[names.index(k) - first] = v
        else: raise KeyError(f'{f.__qualname__} has no argument {k!r} with a default value')
    f.__defaults__, f.__kwdefaults__ = tuple(defaults) or None, kw or None


def install_fixtures(manifest:dict):
    "In this process: no shared data, and the network replaced by the local files of `make_fixtures`."
    import shutil, urllib.error, urllib.request
    import compressive_tutorial.data as D

    def no_shared(starts=None):
        raise FileNotFoundError('no shared/data folder (check_colab: as in Colab)')
    import compressive_tutorial.speech                           # (imports find_shared_data by name: patched below too)
    for m in list(sys.modules.values()):                        # every module of the package that holds the name
        if getattr(m, '__name__', '').startswith(PACKAGE) and hasattr(m, 'find_shared_data'): m.find_shared_data = no_shared
    D._dump_debian = lambda src, dest, download, work, debs: shutil.copyfile(manifest['bible'], dest)
    for f in (D.get_enwik8, D.load_enwik8):                     # the checks the real file gets, with the fake's numbers
        set_defaults(f, size=manifest['enwik8_size'], md5=manifest['enwik8_md5'])
    if manifest.get('ljspeech'):                                # the full corpus's checks, with the fixture's numbers
        import compressive_tutorial.speech as SP
        set_defaults(SP.get_ljspeech, **manifest['ljspeech'])

    class Response(io.BytesIO):
        def __init__(self, data): super().__init__(data); self.headers = {'Content-Length': str(len(data))}
    def urlopen(url, *a, **k):
        url = getattr(url, 'full_url', url)
        if url not in manifest['served']: raise urllib.error.URLError(f'check_colab: no fixture for {url} (no network in this check)')
        return Response(Path(manifest['served'][url]).read_bytes())
    urllib.request.urlopen = urlopen


def child(nb_path:str) -> int:
    "Run one notebook's data path in this process (started by `check_data`); print a JSON summary."
    cells = json.loads(Path(nb_path).read_text(encoding='utf-8'))['cells']
    install_fixtures(json.loads(Path(os.environ['CHECK_COLAB_FIXTURES']).read_text()))
    imports, steps = data_program(cells)
    ns, ran, skipped = {}, [], []
    for line in imports:
        exec(line, ns)
    if (mod := default_exp(cells)): exec(f'from {PACKAGE}.{mod} import *', ns)   # what the notebook's export cells define
    for i, code, is_data in steps:
        missing = sorted(n for n in free_names(code) if n not in ns and not hasattr(__builtins__, n))
        if missing:
            if is_data: skipped.append(f'cell {i}: needs {missing}')
            continue
        t0 = time.perf_counter()
        try: exec(code, ns)
        except BaseException as e:
            print(json.dumps(dict(error=f'cell {i}: {code.splitlines()[0][:100]!r} raised {type(e).__name__}: {str(e)[:400]}', ran=ran)))
            return 1
        if is_data: ran.append(f"cell {i} ({time.perf_counter() - t0:.1f} s): {code.splitlines()[0][:80]}")
    print(json.dumps(dict(ran=ran, skipped=skipped)))
    return 0


def check_data(nb:Path, manifest:Path) -> tuple:
    "(problem or None, lines saying what ran and what was skipped)."
    with tempfile.TemporaryDirectory(prefix='check-colab-') as tmp:
        (Path(tmp) / 'cache').mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ('CT_DATA_DIR', 'IN_TEST')}
        env.update(CT_CACHE_DIR=str(Path(tmp) / 'cache'), CHECK_COLAB_FIXTURES=str(manifest), MPLBACKEND='Agg',
                   PYTHONPATH=str(ROOT) + os.pathsep + env.get('PYTHONPATH', ''))
        try: r = subprocess.run([sys.executable, __file__, '--child', str(nb)], cwd=tmp, env=env, capture_output=True,
                                text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired: return f'its data path did not finish in {TIMEOUT} s', []
    last = (r.stdout.strip().splitlines() or [''])[-1]
    try: res = json.loads(last)
    except json.JSONDecodeError: return f'the check crashed: {r.stderr.strip()[-600:]}', []
    return res.get('error'), [f'    ran {l}' for l in res.get('ran', [])] + [f'    skipped {l}' for l in res.get('skipped', [])]


def main(argv) -> int:
    s = settings()
    nbs = [Path(a).resolve() for a in argv] or notebooks(ROOT / (s['nbs_path'] or 'nbs'))
    shared_books = None
    try:
        sys.path.insert(0, str(ROOT))
        from compressive_tutorial.data import find_shared_data
        shared_books = find_shared_data() / 'books'
    except Exception as e: print(f'(no shared books to serve as fixtures: {e})')
    failed, fixtures = 0, tempfile.TemporaryDirectory(prefix='check-colab-fixtures-')
    manifest = make_fixtures(Path(fixtures.name), shared_books) if shared_books is not None and shared_books.is_dir() else None
    if manifest is None: print('FAIL: colab data: the shared books are needed to serve as download fixtures'); failed += 1
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:                        # two notebooks at a time: each child mostly imports torch
        t0 = time.perf_counter()
        data = {nb: pool.submit(check_data, nb, manifest) for nb in nbs} if manifest is not None else {}
        for nb in nbs:
            rel = nb.relative_to(ROOT).as_posix()
            prob = check_imports(json.loads(nb.read_text(encoding='utf-8'))['cells'])
            if prob: print(f'FAIL: {rel} colab imports: {prob}'); failed += 1
            else: print(f'PASS: {rel} colab imports')
            if nb not in data: continue
            prob, lines = data[nb].result()
            print('\n'.join(lines)) if lines else None
            if prob: print(f'FAIL: {rel} colab data: {prob}'); failed += 1
            else: print(f'PASS: {rel} colab data (done at {time.perf_counter() - t0:.0f} s)')
    fixtures.cleanup()
    return 1 if failed else 0


if __name__ == '__main__':
    if sys.argv[1:2] == ['--child']: sys.exit(child(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
