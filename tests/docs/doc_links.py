#!/usr/bin/env python3
"""Every link between our docs leads somewhere.

Checks, over the repository's files (git ls-files: tracked and new ones not ignored; else a walk of the tree):
  - each Markdown link [text](target) in a .md file whose target is a path of ours: the file or
    folder exists, and a #anchor names a heading of the target (GitHub's heading ids);
  - each citation of a doc in any text file, `docs/<name>.md` or `docs/<name>.md, "Section"`: the file
    exists, and a quoted section name begins a heading of that file.
Prints one line per broken link (file:line: what) and exits 1 if there is any.

usage: doc_links.py REPO_ROOT
"""
import os
import re
import subprocess
import sys

LINK = re.compile(r'(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+"[^"]*")?\)')
CITE = re.compile(r'\b(docs/[A-Za-z0-9_./-]+\.md)(?:\s*,?\s*"([^"]+)")?')
TEXT_EXT = ('.md', '.c', '.h', '.cu', '.py', '.sh', '.build', '.txt', '.in', '.csv', '.toml', '')


def tracked(root):
    try:
        out = subprocess.run(['git', '-C', root, 'ls-files', '-z', '--cached', '--others', '--exclude-standard'], capture_output=True, check=True).stdout
        files = [f for f in out.decode().split('\0') if f]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith('.') and not x.startswith('build')]
        files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return files


def slug(heading):
    """GitHub's id for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    h = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # a link's text only
    h = h.strip().lower()
    h = re.sub(r'[^\w\- ]', '', h)
    return h.replace(' ', '-')


def headings(path, cache={}):
    if path not in cache:
        names, ids, seen, fence = [], set(), {}, False
        with open(path, encoding='utf-8', errors='replace') as f:
            for line in f:
                if line.lstrip().startswith('```'):
                    fence = not fence
                if fence:
                    continue
                m = re.match(r'#{1,6}\s+(.*?)\s*#*\s*$', line)
                if not m:
                    continue
                name = m.group(1)
                names.append(re.sub(r'[`*_]', '', name))
                s = slug(name)
                n = seen.get(s, 0)
                seen[s] = n + 1
                ids.add(s if n == 0 else '%s-%d' % (s, n))
        cache[path] = (names, ids)
    return cache[path]


def strip_code(line):
    return re.sub(r'`[^`]*`', '', line)


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else '.')
    bad = []
    for rel in sorted(tracked(root)):
        path = os.path.join(root, rel)
        if not os.path.isfile(path) or not rel.endswith(TEXT_EXT) or rel.startswith('tests/fuzz/corpus/'):
            continue
        if os.path.splitext(rel)[1] == '' and '/' in rel and not rel.startswith('scripts/'):
            continue
        try:
            with open(path, encoding='utf-8') as f:
                lines = f.read().split('\n')
        except (UnicodeDecodeError, OSError):
            continue
        is_md = rel.endswith('.md')
        fence = False
        for no, line in enumerate(lines, 1):
            where = '%s:%d' % (rel, no)
            if is_md:
                if line.lstrip().startswith('```'):
                    fence = not fence
                    continue
                if fence or line.startswith('    '):
                    continue
                for target in LINK.findall(strip_code(line)):
                    if re.match(r'[a-z][a-z0-9+.-]*:', target):  # http:, mailto:
                        continue
                    file_part, _, anchor = target.partition('#')
                    dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
                    if not os.path.exists(dest):
                        bad.append('%s: link to %s: no such file' % (where, file_part))
                        continue
                    if anchor and dest.endswith('.md') and anchor not in headings(dest)[1]:
                        bad.append('%s: link to %s: no heading with id #%s' % (where, target, anchor))
            for doc, section in CITE.findall(line):
                dest = os.path.join(root, doc)
                if not os.path.isfile(dest):
                    bad.append('%s: cites %s: no such file' % (where, doc))
                elif section and not any(h.lower().startswith(section.lower()) for h in headings(dest)[0]):
                    bad.append('%s: cites %s, "%s": no heading begins so' % (where, doc, section))
    for b in bad:
        print(b)
    if bad:
        print('%d broken link(s) in the docs' % len(bad))
        return 1
    print('docs links: all resolve')
    return 0


if __name__ == '__main__':
    sys.exit(main())
