#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora, tests/fuzz/seeds/<target>/, from
the fixtures and small hand-made files in each input's layout (see the
comment at the top of each tests/fuzz/fuzz_<target>.c). Run it from anywhere;
it replaces the generated seeds and leaves request/ alone.

Seeds are kept to a few KB: a fuzzer mutates small inputs faster, and the
fixtures' tokenizer (21 KB) and weights (500 KB) hold nothing a small file
in the same layout does not."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, '..', '..'))
FIX = os.path.join(ROOT, 'tests', 'fixtures')
SEEDS = os.path.join(HERE, 'seeds')


def out(target, name, data):
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), 'wb') as f:
        f.write(data)


def clear(target):
    d = os.path.join(SEEDS, target)
    if os.path.isdir(d):
        for n in os.listdir(d):
            os.unlink(os.path.join(d, n))


# ---- safetensors ----

DT = {'F32': ('<f', 4), 'F16': ('<e', 2), 'BF16': (None, 2), 'F64': ('<d', 8), 'I64': ('<q', 8),
      'I32': ('<i', 4), 'I16': ('<h', 2), 'I8': ('<b', 1), 'U8': ('<B', 1), 'BOOL': ('<B', 1)}


def tensor_bytes(dtype, n, k):
    fmt, size = DT[dtype]
    if dtype == 'BF16':
        return b''.join(struct.pack('<f', 0.5 * (i + k))[2:] for i in range(n))
    if dtype == 'BOOL':
        return bytes((i + k) & 1 for i in range(n))
    vals = [((i + k) % 7) - 3 if dtype[0] == 'I' else (i + k) % 5 if dtype == 'U8' else 0.25 * (i + k)
            for i in range(n)]
    return b''.join(struct.pack(fmt, v) for v in vals)


def safetensors(tensors, meta=None, pad=True):
    """tensors: [(name, dtype, shape)]; contiguous data in the given order."""
    header, data = {}, b''
    if meta is not None:
        header['__metadata__'] = meta
    for k, (name, dtype, shape) in enumerate(tensors):
        n = 1
        for s in shape:
            n *= s
        b = tensor_bytes(dtype, n, k)
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header, separators=(',', ':')).encode()
    if pad:
        h += b' ' * (-len(h) % 8)
    return struct.pack('<Q', len(h)) + h + data


def gen_safetensors():
    clear('safetensors')
    qwen = [('model.embed_tokens.weight', 'F32', [8, 4]),
            ('model.layers.0.input_layernorm.weight', 'F32', [4]),
            ('model.layers.0.self_attn.q_proj.weight', 'BF16', [4, 4]),
            ('model.layers.0.self_attn.q_proj.bias', 'F16', [4]),
            ('model.norm.weight', 'F32', [4])]
    out('safetensors', 'qwen-tiny.safetensors', safetensors(qwen, {'format': 'pt'}))
    out('safetensors', 'dtypes.safetensors',
        safetensors([('f64', 'F64', [2]), ('i64', 'I64', [3]), ('i32', 'I32', [2, 1]), ('i16', 'I16', [2]),
                     ('i8', 'I8', [3]), ('u8', 'U8', [4]), ('b', 'BOOL', [2]), ('bf', 'BF16', [1, 2, 1])]))
    out('safetensors', 'empty-and-scalar.safetensors',
        safetensors([('empty', 'F32', [0, 4]), ('scalar', 'F32', []), ('after', 'F16', [2])], {}))
    out('safetensors', 'unpadded.safetensors', safetensors([('x', 'F32', [3])], pad=False))
    out('safetensors', 'no-tensors.safetensors', safetensors([], {'format': 'pt'}))
    # The fixture's own header, over a data section cut short: every
    # tensor's offsets point past it, as in a truncated download.
    with open(os.path.join(FIX, 'qwen2', 'model.safetensors'), 'rb') as f:
        hlen = struct.unpack('<Q', f.read(8))[0]
        head = f.read(hlen)
    out('safetensors', 'qwen2-header-truncated.safetensors', struct.pack('<Q', hlen) + head + b'\0' * 64)
    a = safetensors(qwen[:3], {'format': 'pt'})
    b = safetensors(qwen[3:], {'format': 'pt'})
    index = {'metadata': {'total_size': 200},
             'weight_map': {name: ('a.safetensors' if i < 3 else 'b.safetensors')
                            for i, (name, _, _) in enumerate(qwen)}}
    out('safetensors', 'index-two-shards', json.dumps(index).encode() + b'|SHARD|' + a + b'|SHARD|' + b)
    index1 = {'weight_map': {'x': 'a.safetensors'}}
    out('safetensors', 'index-one-shard',
        json.dumps(index1).encode() + b'|SHARD|' + safetensors([('x', 'F32', [2])]))


# ---- config.json ----

def gen_config():
    clear('config')
    for fx in ('qwen2', 'llama', 'qwen3', 'qwen2-classify'):
        with open(os.path.join(FIX, fx, 'config.json'), 'rb') as f:
            out('config', fx + '.json', f.read())
    out('config', 'rope-parameters.json', json.dumps({
        'model_type': 'llama', 'vocab_size': 32, 'hidden_size': 16, 'intermediate_size': 32,
        'num_hidden_layers': 1, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 8,
        'rope_parameters': {'rope_type': 'default', 'rope_theta': 500000.0}, 'eos_token_id': [2, 3],
        'bos_token_id': None, 'torch_dtype': 'bfloat16', 'attention_bias': True, 'mlp_bias': True,
        'layer_types': ['full_attention'], 'hidden_act': 'silu', 'id2label': {'0': 'a', '1': 'b'}}))


# ---- tokenizer.json ----

def bytes_to_unicode():
    bs = list(range(ord('!'), ord('~') + 1)) + list(range(0xa1, 0xac + 1)) + list(range(0xae, 0xff + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


QWEN_RE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
           "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def tokenizer(vocab_bytes, merges, added, normalizer, pre, post=None, legacy_merges=False, extra=None):
    bl = bytes_to_unicode()
    vocab = {}
    for a in added:
        vocab[a['content']] = a['id']
    nid = max([a['id'] for a in added] + [-1]) + 1
    for b in vocab_bytes:
        if bl[b] not in vocab:
            vocab[bl[b]] = nid
            nid += 1
    ms = []
    for a, b in merges:
        a, b = ''.join(bl[c] for c in a.encode()), ''.join(bl[c] for c in b.encode())
        if a + b not in vocab:
            vocab[a + b] = nid
            nid += 1
        ms.append(a + ' ' + b if legacy_merges else [a, b])
    model = {'type': 'BPE', 'dropout': None, 'unk_token': None, 'continuing_subword_prefix': None,
             'end_of_word_suffix': None, 'fuse_unk': False, 'byte_fallback': False, 'ignore_merges': False,
             'vocab': vocab, 'merges': ms}
    if extra:
        model.update(extra)
    t = {'version': '1.0', 'truncation': None, 'padding': None,
         'added_tokens': [dict({'single_word': False, 'lstrip': False, 'rstrip': False, 'normalized': False,
                                'special': True}, **a) for a in added],
         'normalizer': normalizer, 'pre_tokenizer': pre, 'post_processor': post,
         'decoder': {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': True, 'use_regex': True},
         'model': model}
    return json.dumps(t, ensure_ascii=False, separators=(',', ':'))


def gen_tokenizer():
    clear('tokenizer')
    ascii_bytes = list(range(0x20, 0x7f)) + [0x0a, 0xc3, 0xa9, 0xe2, 0x80, 0x94]
    chatml = [{'id': 0, 'content': '<|endoftext|>'}, {'id': 1, 'content': '<|im_start|>'},
              {'id': 2, 'content': '<|im_end|>'}]
    merges = [(' ', 't'), ('h', 'e'), (' ', 'a'), ('i', 'n'), (' t', 'he'), ('e', 'r'), ('o', 'n'), ('l', 'l')]
    text = '\0Hello <|im_start|>user\nthe cat\u00e9 isn\'t 42 \u2014 <|endoftext|>  x\n'
    qwen_pre = {'type': 'Sequence', 'pretokenizers': [
        {'type': 'Split', 'pattern': {'Regex': QWEN_RE}, 'behavior': 'Isolated', 'invert': False},
        {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': False}]}
    out('tokenizer', 'qwen-nfc', tokenizer(ascii_bytes, merges, chatml, {'type': 'NFC'}, qwen_pre) + text)
    # GPT-2's layout: ByteLevel with its own regex, merges as "a b" strings,
    # a template post-processor and a normalizer Sequence.
    post = {'type': 'TemplateProcessing', 'single': [{'SpecialToken': {'id': '<|endoftext|>', 'type_id': 0}},
                                                     {'Sequence': {'id': 'A', 'type_id': 0}},
                                                     {'SpecialToken': {'id': '<|im_end|>', 'type_id': 0}}],
            'pair': [], 'special_tokens': {'<|endoftext|>': {'id': '<|endoftext|>', 'ids': [0], 'tokens': ['<|endoftext|>']},
                                           '<|im_end|>': {'id': '<|im_end|>', 'ids': [2], 'tokens': ['<|im_end|>']}}}
    out('tokenizer', 'gpt2-template',
        tokenizer(ascii_bytes, merges, chatml, {'type': 'Sequence', 'normalizers': [{'type': 'NFKC'}]},
                  {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': True, 'use_regex': True},
                  post, legacy_merges=True) + text)
    # Added tokens with lstrip/rstrip/single_word and a normalized one,
    # two Split steps of other behaviours, ignore_merges, an unk token.
    added = [{'id': 0, 'content': '<|endoftext|>'},
             {'id': 1, 'content': '<tool>', 'lstrip': True, 'rstrip': True},
             {'id': 2, 'content': 'cat', 'single_word': True, 'special': False, 'normalized': True}]
    pre = {'type': 'Sequence', 'pretokenizers': [
        {'type': 'Split', 'pattern': {'String': ' '}, 'behavior': 'MergedWithNext', 'invert': False},
        {'type': 'Split', 'pattern': {'Regex': '\\p{N}{1,3}'}, 'behavior': 'Removed', 'invert': False},
        {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': False}]}
    post = {'type': 'Sequence', 'processors': [{'type': 'ByteLevel'},
                                               {'type': 'RobertaProcessing', 'cls': ['<|endoftext|>', 0],
                                                'sep': ['<tool>', 1]}]}
    out('tokenizer', 'added-flags',
        tokenizer(ascii_bytes, merges, added, {'type': 'NFD'}, pre, post,
                  extra={'ignore_merges': True, 'unk_token': '?'}) +
        '\0 <tool> the cat sat, 12345 concat <|endoftext|>')


# ---- JSONL rows ----

def gen_jsonl():
    clear('jsonl')
    # The options byte: kind in bits 0-2, then add_special_tokens (3),
    # assistant_only_loss (4), template line (5), label names (6), vocab 300 (7).
    rows = {
        'text': (1, [{'text': 'The cat sat on the mat.'}, {'text': ''}, {'text': 'caf\u00e9 <|im_end|>\n'}]),
        'prompt-completion': (2, [{'prompt': 'Q: 2+2?', 'completion': ' 4'},
                                  {'prompt': '', 'completion': 'x'}]),
        'messages': (3, [{'messages': [{'role': 'system', 'content': 'Be brief.'},
                                       {'role': 'user', 'content': 'Hi'},
                                       {'role': 'assistant', 'content': 'Hello!'}]}]),
        'classify': (4 | 0x40, [{'text': 'great', 'label': 'pos'}, {'text': 'bad', 'label': 0},
                                {'text': 'meh', 'label': 'neutral'}]),
        'auto': (0, [{'prompt': 'a', 'completion': 'b'}, {'prompt': 'c', 'completion': 'd'}]),
        'auto-messages-assistant-only': (0x10, [{'messages': [{'role': 'user', 'content': 'x'},
                                                              {'role': 'assistant', 'content': 'y'}]}]),
        'text-add-special-small-vocab': (1 | 0x08 | 0x80, [{'text': 'zzz ~~~ \u00e9\u00e9'}]),
    }
    for name, (opt, lines) in rows.items():
        body = '\n'.join(json.dumps(r, ensure_ascii=False) for r in lines) + '\n  \n'
        out('jsonl', name, bytes([opt]) + body.encode())
    tpl = '[{role}]: {content}{{end}}\n'
    out('jsonl', 'messages-template', bytes([3 | 0x20]) + (tpl + json.dumps(
        {'messages': [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': 'a'}]}) + '\n').encode())


# ---- job specs ----

def gen_jobspec():
    clear('jobspec')
    with open(os.path.join(ROOT, 'tests', 'integration', 'job.txtpb'), 'rb') as f:
        out('jobspec', 'it-job.txtpb', f.read())
    with open(os.path.join(FIX, 'demo', 'job.txtpb'), 'rb') as f:
        out('jobspec', 'demo-job.txtpb', f.read())
    # Every section and field of proto/example-job.txtpb, without its comments.
    with open(os.path.join(ROOT, 'proto', 'example-job.txtpb')) as f:
        lines = [l for l in f.read().splitlines() if l.strip() and not l.strip().startswith('#')]
    out('jobspec', 'example-job.txtpb', '\n'.join(lines) + '\n')
    out('jobspec', 'text-errors.txtpb', 'name: "x"\nhyper { lr: oops }\nnope: 1\n')


# ---- token cache ----

def gen_tokcache():
    clear('tokcache')
    key = (0x746472616964636b, 0x313230327a7a7566)  # fuzz_tokcache.c's KEY0, KEY1

    def cache(rows, kind):
        toks, idx, at = b'', b'', 0
        for ids, cls in rows:
            toks += b''.join(struct.pack('<I', i) for i in ids)
            idx += struct.pack('<QIi', at, len(ids), cls)
            at += len(ids)
        head = struct.pack('<8sQQQQQII', b'TDROWS1\0', key[0], key[1], len(rows), at, 100, kind, 0)
        return bytes([kind == 4]) + head + idx + b'|TOKENS|' + toks

    # kinds: train/data.h's enum tr_rows (1 text, 4 classify); the first
    # byte tells the harness which the job expects.
    out('tokcache', 'text', cache([([10, 11, 12, 0], -1), ([0x80000000 | 5, 6, 0], -1), ([7], -1)], 1))
    out('tokcache', 'classify', cache([([10, 11], 0), ([12], 2), ([13, 14, 15], 1)], 4))


if __name__ == '__main__':
    gen_safetensors()
    gen_config()
    gen_tokenizer()
    gen_jsonl()
    gen_jobspec()
    gen_tokcache()
