"""A small reader of C headers of the shape public C library headers have (mplane_ep.h): integer
#defines, enums, structs, typedefs and function prototypes; and a canonical spelling of C types and
of ctypes types, so a ctypes binding can be compared with the header it mirrors.

Canonical types: i8 u8 i16 u16 i32 u32 i64 u64 f32 f64 void, 'str' (char *), 'ptr' (any other
data pointer), 'ptr(struct NAME)', 'ptr(ptr)' (pointer to a pointer), 'fn' (function pointer),
'struct NAME' (by value), and 'T[N]' for arrays. Assumes LP64 (Linux x86-64 / aarch64)."""

import ctypes
import re

SCALARS = {
    "char": "i8", "signed char": "i8", "unsigned char": "u8", "int8_t": "i8", "uint8_t": "u8", "bool": "u8",
    "_Bool": "u8", "short": "i16", "unsigned short": "u16", "int16_t": "i16", "uint16_t": "u16",
    "int": "i32", "signed": "i32", "signed int": "i32", "unsigned": "u32", "unsigned int": "u32",
    "int32_t": "i32", "uint32_t": "u32", "long": "i64", "long int": "i64", "unsigned long": "u64",
    "long long": "i64", "unsigned long long": "u64", "int64_t": "i64", "uint64_t": "u64",
    "size_t": "u64", "ssize_t": "i64", "ptrdiff_t": "i64", "intptr_t": "i64", "uintptr_t": "u64",
    "float": "f32", "double": "f64", "void": "void",
}
# Types from CUDA / NCCL headers that public headers use: pointers to opaque structs.
OPAQUE_POINTER_TYPES = {"cudaStream_t", "cudaEvent_t", "ncclComm_t", "CUstream", "CUevent"}
# ... and enums from them (int-sized).
FOREIGN_ENUMS = {"ncclResult_t", "cudaError_t", "ncclDataType_t", "ncclRedOp_t"}


class Header:
    def __init__(self):
        self.defines = {}    # NAME -> int
        self.enums = {}      # NAME -> int (enumerators)
        self.enum_types = set()
        self.structs = {}    # struct name -> [(field, canonical type)]
        self.struct_alias = {}  # typedef name -> struct name
        self.typedefs = {}   # typedef name -> canonical type
        self.functions = {}  # name -> (ret, [arg canonical types], [arg names])

    def constants(self):
        d = dict(self.defines)
        d.update(self.enums)
        return d


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def int_value(expr, known):
    """Value of a simple integer expression (literals, known names, + - * << | ~ ( )), or None."""
    e = expr.strip()
    if not e:
        return None
    e = re.sub(r"(?<=[0-9a-fA-FxX])[uUlL]+\b", "", e)
    if not re.fullmatch(r"[\w\s()+\-*/<>|&~^]+", e):
        return None
    toks = re.findall(r"[A-Za-z_]\w*", e)
    for t in toks:
        if t not in known and not re.fullmatch(r"0[xX][0-9a-fA-F]+", t):
            return None
    try:
        v = eval(e.replace("/", "//"), {"__builtins__": {}}, dict(known))  # noqa: S307 - arithmetic only
    except Exception:
        return None
    return v if isinstance(v, int) else None


def split_top(text, sep=";"):
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "{(":
            depth += 1
        elif ch in "})":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse(text):
    h = Header()
    text = strip_comments(text)
    text = text.replace("\\\n", " ")
    body = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            m = re.match(r"#\s*define\s+(\w+)\s+(.+)$", s)
            if m and "(" not in m.group(1):
                v = int_value(m.group(2), {**h.defines, **h.enums})
                if v is not None:
                    h.defines[m.group(1)] = v
            continue
        body.append(line)
    text = "\n".join(body)
    text = re.sub(r'extern\s+"C"\s*\{', " ", text)
    # a lone closing brace of extern "C" would unbalance the split: drop unmatched ones
    depth, kept = 0, []
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                continue
            depth -= 1
        kept.append(ch)
    text = "".join(kept)
    for decl in split_top(text):
        decl = " ".join(decl.split())
        if decl:
            _decl(h, decl)
    return h


def _enum_body(h, body):
    val = -1
    for item in split_top(body, ","):
        if not item:
            continue
        name, _, expr = item.partition("=")
        name = name.strip()
        if expr.strip():
            v = int_value(expr, {**h.defines, **h.enums})
            if v is None:
                raise ValueError(f"enumerator {name}: cannot evaluate '{expr.strip()}'")
            val = v
        else:
            val += 1
        h.enums[name] = val


def _decl(h, d):
    d = re.sub(r"\b(extern|static|inline|__attribute__\s*\(\(.*?\)\))\b", " ", d).strip()
    d = re.sub(r"\b(MPLANE_EP_API|MP_EP_API)\b", " ", d).strip()
    m = re.fullmatch(r"(typedef\s+)?enum\s*(\w+)?\s*\{(.*)\}\s*(\w+)?", d, flags=re.S)
    if m:
        _enum_body(h, m.group(3))
        for n in (m.group(2), m.group(4)):
            if n:
                h.enum_types.add(n)
        return
    m = re.fullmatch(r"(typedef\s+)?struct\s*(\w+)?\s*\{(.*)\}\s*(\w+)?", d, flags=re.S)
    if m:
        sname = m.group(2) or m.group(4)
        fields = []
        for f in split_top(m.group(3)):
            f = " ".join(f.split())
            if not f:
                continue
            # int a, b; -> two fields of the same type
            first, *rest = [x.strip() for x in f.split(",")]
            base, name, ctype = _declarator(h, first)
            fields.append((name, ctype))
            stars_base = re.match(r"[^*\[]*", base).group(0)
            for r in rest:
                _, name2, ctype2 = _declarator(h, stars_base + " " + r)
                fields.append((name2, ctype2))
        h.structs[sname] = fields
        if m.group(4):
            h.struct_alias[m.group(4)] = sname
        return
    m = re.fullmatch(r"typedef\s+struct\s+(\w+)\s*(\**)\s*(\w+)", d)
    if m:
        if m.group(2):
            h.typedefs[m.group(3)] = "ptr"
        else:
            h.struct_alias[m.group(3)] = m.group(1)
        return
    m = re.fullmatch(r"typedef\s+enum\s+(\w+)\s+(\w+)", d)
    if m:
        h.enum_types.add(m.group(2))
        return
    if d.startswith("typedef"):
        inner = d[len("typedef"):].strip()
        if re.search(r"\(\s*\*\s*(\w+)\s*\)\s*\(", inner):  # function pointer typedef
            name = re.search(r"\(\s*\*\s*(\w+)\s*\)", inner).group(1)
            h.typedefs[name] = "fn"
            return
        _, name, ctype = _declarator(h, inner)
        h.typedefs[name] = ctype
        return
    m = re.fullmatch(r"(.+?)\b(\w+)\s*\((.*)\)", d, flags=re.S)
    if m and "{" not in d:
        ret = canon(h, m.group(1))
        args, names = [], []
        a = m.group(3).strip()
        if a and a != "void":
            for p in split_top(a, ","):
                _, pname, ptype = _declarator(h, p, allow_unnamed=True)
                args.append(ptype)
                names.append(pname)
        h.functions[m.group(2)] = (ret, args, names)


def _declarator(h, text, allow_unnamed=False):
    """'const int *x[4]' -> (base text, 'x', canonical type)."""
    t = " ".join(text.split())
    if re.search(r"\(\s*\*", t):  # function pointer
        name = re.search(r"\(\s*\*\s*(\w*)\s*\)", t).group(1)
        return t, name, "fn"
    arr = ""
    m = re.search(r"((?:\[\s*[^\]]*\])+)\s*$", t)
    if m:
        dims = re.findall(r"\[\s*([^\]]*)\]", m.group(1))
        t = t[:m.start()].strip()
        arr = "".join(f"[{int_value(x, {**h.defines, **h.enums}) if x.strip() else ''}]" for x in dims)
    m = re.fullmatch(r"(.*?[\s*])(\w+)", t)
    name = ""
    if m and m.group(2) not in SCALARS and not (allow_unnamed and _is_type_word(h, m.group(2), m.group(1))):
        base, name = m.group(1), m.group(2)
    else:
        base = t
    ctype = canon(h, base)
    if arr:
        if allow_unnamed:
            ctype = "ptr"  # an array parameter is a pointer
        elif not name:
            raise ValueError(f"cannot read declaration '{text}'")
        else:
            ctype = ctype + arr
    return base, name, ctype


def _is_type_word(h, word, before):
    """In an unnamed parameter ('const foo_t *' or 'int'), is the last word the type itself?"""
    return not before.strip().rstrip("*").strip() or before.strip() in ("const", "struct", "enum", "unsigned", "signed")


def canon(h, text):
    t = " ".join(text.replace("*", " * ").split())
    stars = t.count("*")
    words = [w for w in t.replace("*", " ").split()
             if w not in ("const", "volatile", "restrict", "__restrict", "__restrict__", "struct", "enum")]
    base = " ".join(words)
    if base in SCALARS:
        b = SCALARS[base]
    elif base in h.struct_alias or base in h.structs:
        b = "struct " + h.struct_alias.get(base, base)
    elif base in h.enum_types or base in FOREIGN_ENUMS:
        b = "i32"
    elif base in OPAQUE_POINTER_TYPES:
        return "ptr" if stars == 0 else "ptr(ptr)"
    elif base in h.typedefs:
        b = h.typedefs[base]
        if b in ("ptr", "fn", "str"):
            return b if stars == 0 else "ptr(ptr)"
    else:
        # an unknown name: an incomplete struct used only through pointers
        b = "struct " + base
    if stars == 0:
        return b
    if stars >= 2:
        return "ptr(ptr)"
    if b in ("i8",) and "char" in base:
        return "str"
    if b.startswith("struct "):
        # a pointer to a struct the header defines; an opaque (incomplete) struct is a plain pointer
        return f"ptr({b})" if b[len("struct "):] in h.structs else "ptr"
    return "ptr"


# ---- ctypes side ----

_CT = [
    (ctypes.c_char_p, "str"), (ctypes.c_void_p, "ptr"), (ctypes.c_bool, "u8"),
    (ctypes.c_int8, "i8"), (ctypes.c_uint8, "u8"), (ctypes.c_int16, "i16"), (ctypes.c_uint16, "u16"),
    (ctypes.c_int32, "i32"), (ctypes.c_uint32, "u32"), (ctypes.c_int64, "i64"), (ctypes.c_uint64, "u64"),
    (ctypes.c_float, "f32"), (ctypes.c_double, "f64"), (ctypes.c_char, "i8"),
    (ctypes.c_size_t, "u64"), (ctypes.c_ssize_t, "i64"), (ctypes.c_long, "i64"), (ctypes.c_ulong, "u64"),
    (ctypes.c_int, "i32"), (ctypes.c_uint, "u32"), (ctypes.c_longlong, "i64"), (ctypes.c_ulonglong, "u64"),
]


def ctypes_canon(t):
    if t is None:
        return "void"
    for ct, name in _CT:
        if t is ct:
            return name
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return "struct " + getattr(t, "_c_name_", t.__name__)
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return f"{ctypes_canon(t._type_)}[{t._length_}]"
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        inner = t._type_
        if isinstance(inner, type) and issubclass(inner, ctypes.Structure):
            return f"ptr({ctypes_canon(inner)})"
        if inner in (ctypes.c_void_p, ctypes.c_char_p) or (isinstance(inner, type) and issubclass(inner, ctypes._Pointer)):
            return "ptr(ptr)"
        return "ptr"
    if isinstance(t, type) and issubclass(t, ctypes._CFuncPtr):
        return "fn"
    return f"?{t!r}"


def compare(header, functions, structs, constants, prefix):
    """Differences between a header and a binding, as a list of sentences (empty: they agree).
    functions: name -> (restype, [argtypes]); structs: ctypes.Structure classes (with _c_name_);
    constants: name -> int. Only header names starting with prefix (case-insensitive) count."""
    errs = []
    pre = prefix.lower()
    hf = {n: v for n, v in header.functions.items() if n.lower().startswith(pre)}
    for n in sorted(set(hf) - set(functions)):
        errs.append(f"function {n} is in the header but not bound")
    for n in sorted(set(functions) - set(hf)):
        errs.append(f"function {n} is bound but not in the header")
    for n in sorted(set(hf) & set(functions)):
        ret, args, names = hf[n]
        bret, bargs = functions[n]
        if ctypes_canon(bret) != ret:
            errs.append(f"{n}: returns {ret} in the header, {ctypes_canon(bret)} in the binding")
        if len(bargs) != len(args):
            errs.append(f"{n}: {len(args)} parameters in the header ({', '.join(names)}), {len(bargs)} bound")
            continue
        for i, (a, b) in enumerate(zip(args, bargs)):
            if ctypes_canon(b) != a:
                errs.append(f"{n}: parameter {i} ({names[i] or '?'}) is {a} in the header, {ctypes_canon(b)} bound")
    bs = {getattr(s, "_c_name_", s.__name__): s for s in structs}
    for sname in sorted(bs):
        if sname not in header.structs:
            errs.append(f"struct {sname} is bound but not in the header")
            continue
        hfields = header.structs[sname]
        bfields = [(f[0], ctypes_canon(f[1])) for f in bs[sname]._fields_]
        if hfields != bfields:
            i = next((i for i, (a, b) in enumerate(zip(hfields, bfields)) if a != b), min(len(hfields), len(bfields)))
            h_at = hfields[i] if i < len(hfields) else "(end)"
            b_at = bfields[i] if i < len(bfields) else "(end)"
            errs.append(f"struct {sname}: field {i} is {h_at} in the header, {b_at} bound "
                        f"({len(hfields)} fields in the header, {len(bfields)} bound)")
    hs = {n for n in header.structs if n.lower().startswith(pre)}
    for sname in sorted(hs - set(bs)):
        errs.append(f"struct {sname} is in the header but not bound")
    hc = {n: v for n, v in header.constants().items() if n.lower().startswith(pre)}
    for n in sorted(hc):
        if n not in constants:
            errs.append(f"constant {n} = {hc[n]} is in the header but not in the binding")
        elif constants[n] != hc[n]:
            errs.append(f"constant {n} is {hc[n]} in the header, {constants[n]} in the binding")
    for n in sorted(set(constants) - set(hc)):
        errs.append(f"constant {n} is in the binding but not in the header")
    return errs
