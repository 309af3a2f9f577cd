"""Builds the default mesh's tokenizer (``skymesh/assets/tokenizer/``), offline and
reproducibly: ``python -m skymesh.assets.build_tokenizer [--out DIR] [--check]``.

A byte-level BPE (HF ``tokenizers``, as Llama 3 and GPT-2 tokenize: any text encodes)
trained on an English-ish corpus generated here from a fixed word list and a fixed
pseudo-random sequence (nothing is downloaded), with Llama's special tokens ``<s>`` (BOS,
id 0, added in front of a prompt by the post-processor as vLLM encodes a completion
prompt) and ``</s>`` (EOS, id 1). The folder is what ``transformers.AutoTokenizer``,
vLLM's ``--tokenizer`` and the benchmark clients load offline: ``tokenizer.json``,
``tokenizer_config.json`` (``PreTrainedTokenizerFast``), ``special_tokens_map.json``, and a
``config.json`` naming the vocabulary (vLLM's tokenizer loader reads one; there are no weights).
``--check`` rebuilds into a temporary folder and fails when the shipped files differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from skymesh.assets import SIM_TOKENIZER_DIR
from skymesh.assets.bpe import train_byte_bpe

VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 131072  # the stand-in profiles' longest context
BOS, EOS = "<s>", "</s>"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")

_WORDS = """
the of and to a in is it you that he was for on are with as his they be at one have
this from or had by word but what some we can out other were all there when up use your
how said an each she which do their time if will way about many then them write would
like so these her long make thing see him two has look more day could go come did number
sound no most people my over know water than call first who may down side been now find
any new work part take get place made live where after back little only round man year
came show every good me give our under name very through just form sentence great think
say help low line differ turn cause much mean before move right boy old too same tell
does set three want air well also play small end put home read hand port large spell add
even land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father head
stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start
might story saw far sea draw left late run while press close night real life few north
open seem together next white children begin got walk example ease paper group always
music those both mark often letter until mile river car feet care second book carry took
science eat room friend began idea fish mountain stop once base hear horse cut sure watch
color face wood main enough plain girl usual young ready above ever red list though feel
talk bird soon body dog family direct pose leave song measure door product black short
numeral class wind question happen complete ship area half rock order fire south problem
piece told knew pass since top whole king space heard best hour better true during hundred
five remember step early hold west ground interest reach fast verb sing listen six table
travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power
town fine certain fly fall lead cry dark machine note wait plan figure star box noun field
rest correct able pound done beauty drive stood contain front teach week final gave green
quick develop ocean warm free minute strong special mind behind clear tail produce fact
street inch multiply nothing course stay wheel full force blue object decide surface deep
moon island foot system busy test record boat common gold possible plane stead dry wonder
laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring yes
distant fill east paint language among model request server region latency cache token
prompt replica balancer prefix block hash route mesh queue answer user assistant message
network traffic compute memory data value result function return class import error file
write read string number list object update deliver measure report signal schedule batch
hello world brown fox jumps lazy quiet emergency broadcast happy sad angry calm bright
dark early late fresh clean dirty empty heavy light narrow wide thick thin soft loud
sweet bitter sour salty rich poor cheap expensive simple complex modern ancient public
private local global national social political economic medical legal natural human
animal forest desert valley village garden kitchen window bottle glass chair bed table
phone computer screen keyboard internet website email account password security policy
history future present market price cost value profit customer service support product
company business manager employee office meeting project team member leader decision
question problem solution method process reason effect purpose effort energy health
doctor nurse patient hospital medicine disease treatment teacher student lesson course
university college library research theory evidence experiment analysis information
knowledge education culture society government election president minister officer
police army battle weapon peace conflict history century decade yesterday today tomorrow
monday tuesday wednesday thursday friday saturday sunday january february march april
june july august september october november december spring summer autumn winter weather
breakfast lunch dinner coffee tea bread butter cheese chicken apple orange banana
potato tomato sugar salt rice soup cake wine beer milk egg meat vegetable fruit
running walking talking thinking working playing reading writing building learning
started finished created changed moved opened closed called asked answered wanted needed
because however therefore although unless whether either neither instead perhaps maybe
really actually probably certainly quickly slowly easily finally usually already almost
something anything everything someone anyone everyone somewhere nowhere himself herself
themselves yourself itself myself ourselves another without within around across along
"""

_SYLLABLES = ("ka ri to na me lo su vi pe da mo ru shi te ba go ni ha fu ze ko ya mi "
              "ra ne po tu le sa di ve ju qu xi ow en ar th st ing ed er al ion").split()
_PUNCTUATION = (".", ",", ".", "?", "!", ";", ":")


def _lcg(seed: int) -> Iterator[int]:
    """A fixed pseudo-random sequence (64-bit LCG, Knuth's constants): the corpus is the
    same on every machine and Python version."""
    x = seed
    while True:
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        yield x >> 33


def corpus(lines: int = 6000, seed: int = 20261126) -> list[str]:
    """English-ish text: sentences of common words (capitalized, punctuated), numbers,
    invented words from syllables, and a few code-like and JSON-like lines."""
    words = _WORDS.split()
    rnd = _lcg(seed)
    out: list[str] = []
    for n in range(lines):
        kind = n % 10
        if kind == 8:  # code-like
            a, b = words[next(rnd) % len(words)], words[next(rnd) % len(words)]
            out.append(f"def {a}_{b}(x, y={next(rnd) % 100}):\n    return {a}(x) + {b}[y]  # {a} {b}")
            continue
        if kind == 9:  # JSON-like
            a, b = words[next(rnd) % len(words)], words[next(rnd) % len(words)]
            out.append(json.dumps({a: next(rnd) % 10000, b: f"{a} {b}", "id": f"{next(rnd) % 65536:04x}"}))
            continue
        sentences = []
        for _ in range(1 + next(rnd) % 4):
            sentence = []
            for k in range(4 + next(rnd) % 14):
                r = next(rnd) % 100
                if r < 90:
                    w = words[next(rnd) % len(words)]
                elif r < 95:
                    w = "".join(_SYLLABLES[next(rnd) % len(_SYLLABLES)] for _ in range(2 + next(rnd) % 3))
                else:
                    w = str(next(rnd) % (10 ** (1 + next(rnd) % 5)))
                sentence.append(w.capitalize() if k == 0 else w)
            sentences.append(" ".join(sentence) + _PUNCTUATION[next(rnd) % len(_PUNCTUATION)])
        out.append(" ".join(sentences))
    return out


def build(out: Path) -> None:
    """Train the tokenizer and write the folder's files into ``out``."""
    from tokenizers import processors

    out.mkdir(parents=True, exist_ok=True)
    tok = train_byte_bpe(corpus(), VOCAB_SIZE, special_tokens=[BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "add_bos_token": True, "add_eos_token": False, "model_max_length": MODEL_MAX_LENGTH,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=1) + "\n")
    # no model has these weights: vLLM's get_tokenizer (the bench clients) reads a
    # config.json beside the tokenizer and, without one, logs an error and retries 2 s later
    model = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": tok.get_vocab_size(),
             "bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": MODEL_MAX_LENGTH}
    (out / "config.json").write_text(json.dumps(model, indent=1) + "\n")


def differing_files(a: Path, b: Path) -> list[str]:
    """The folder files whose bytes differ between ``a`` and ``b``."""
    def data(p: Path) -> bytes | None:
        return p.read_bytes() if p.is_file() else None

    return [name for name in FILES if data(a / name) != data(b / name)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skymesh.assets.build_tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=SIM_TOKENIZER_DIR, help="the folder to write (default: the shipped one)")
    p.add_argument("--check", action="store_true", help="rebuild into a temporary folder and compare with --out")
    args = p.parse_args(argv)
    if not args.check:
        build(args.out)
        print(f"wrote {', '.join(FILES)} to {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        differ = differing_files(Path(tmp), args.out)
    if differ:
        print(f"{args.out}: differs from a fresh build: {', '.join(differ)}", file=sys.stderr)
        return 1
    print(f"{args.out}: same as a fresh build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
