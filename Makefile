# Every target runs inside .venv, made on first use. `make help` lists them.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Set-up is course/setup.py, which works without make too (Windows): `python3 -m course setup`.
SETUP := $(PYTHON) -m course setup
# Workers share the cores: see course/runtime/env.py. Tests run two pytest processes.
PYTEST := $(PY) -m pytest -n 2

.PHONY: help setup notebooks test grade non-iid bench bench-launch bench-cost bench-zero bench-fsdp bench-tp bench-pp bench-nd bench-ep bench-ft

# The students' part of `make help`; the instructors' repository (with solutions/) adds its own below.
help::
	@echo "make setup    make .venv with what the .py exercises and grading need"
	@echo "make notebooks  also JupyterLab (to open exercises/*.ipynb) and matplotlib (the plots)"
	@echo "make grade    grade your exercise files: mlp.py, dist.py, ... (EX=2 for one exercise, EX=\"6 7\" for two)"
	@echo "make non-iid  exercise 9's experiment: IID or label-disjoint shards, synchronous or local SGD (non_iid.png, .json)"
	@echo "make bench    step time of DDP and MyDP variants, ring all-reduce against gloo (exercises 4-6)"
	@echo "make bench-launch  what starting a world of workers costs, per start method"
	@echo "make bench-cost    exercise 12's cost model: predicted against measured steps of MyDP and OverlappedDP"
	@echo "make bench-zero    optimizer-state bytes per rank and step time of sharded Adam (exercise 11)"
	@echo "make bench-fsdp    bytes per rank and step time of DDP, ZeRO-1, -2, -3 and torch's fully_shard (exercise 13)"
	@echo "make bench-tp      tensor against data parallelism by batch size, measured and predicted (exercise 14)"
	@echo "make bench-pp      a pipeline's idle fraction against (p - 1)/(m + p - 1), step time of GPipe and 1F1B (exercise 15)"
	@echo "make bench-nd      step time and bytes per rank of the meshes (4, 1), (2, 2), (1, 4), measured and predicted (exercise 16)"
	@echo "make bench-ep      an all-to-all, even and uneven, against an all-reduce of the same bytes, measured and predicted (exercise 18)"
	@echo "make bench-ft      what a restart after a rank's death costs: the new world, the load, the first step, a save (exercise 17)"

$(VENV)/.installed: requirements.txt pyproject.toml
	$(SETUP)

$(VENV)/.notebooks: requirements-notebooks.txt $(VENV)/.installed
	$(SETUP) --notebooks

setup: $(VENV)/.installed

notebooks: $(VENV)/.notebooks

# Exercise 9's experiment (about a minute on 2 cores): your sync.py; the reference where there is one.
non-iid: $(VENV)/.installed
	$(PY) $(if $(wildcard solutions/.),solutions/)sync.py --non-iid-plot non_iid.png

# A score below full marks is not an error; a broken grader is (see course/grading/plugin.py).
grade: $(VENV)/.installed
	@$(PY) -m course grade $(foreach e,$(EX),--ex $(e))

# The benchmarks measure the reference solutions where there are some, else your own files
# (course/impl.py); they plot with matplotlib where it is installed (make notebooks).
bench: $(VENV)/.installed
	$(PY) bench/overlap.py

bench-launch: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) bench/launch_cost.py

bench-cost: $(VENV)/.installed
	$(PY) bench/cost.py

bench-zero: $(VENV)/.installed
	$(PY) bench/zero.py

bench-fsdp: $(VENV)/.installed
	$(PY) bench/fsdp.py

bench-tp: $(VENV)/.installed
	$(PY) bench/tp.py

bench-pp: $(VENV)/.installed
	$(PY) bench/pp.py

bench-nd: $(VENV)/.installed
	$(PY) bench/nd.py

bench-ep: $(VENV)/.installed
	$(PY) bench/ep.py

bench-ft: $(VENV)/.installed
	$(PY) bench/ft.py

# Targets that need solutions/. The students' copy (make release) has none: there `make test` is
# `make grade`, and the others are not defined.
ifneq ($(wildcard solutions/.),)
.PHONY: demo compat lint student release gradescope classroom autograde bench-grade gpu-check

help::
	@echo ""
	@echo "Instructors (this repository, with solutions/):"
	@echo "make demo     run every reference solution on CPU"
	@echo "make compat TORCH=2.11.0  every exercise's checks and reference script under that torch (a side venv, cached)"
	@echo "make test     the test suite: the reference solutions and the repository's own checks"
	@echo "make lint     ruff: the checks and the formatting of pyproject.toml"
	@echo "make student  regenerate the student files (mlp.py, dist.py, ...) and exercises/*.ipynb from solutions/"
	@echo "make release DEST=dir          write the students' copy (no solutions)"
	@echo "make gradescope                autograder.zip, a Gradescope autograder (EX=\"6 7\": this week's)"
	@echo "make classroom DEST=dir TEMPLATE=owner/name  GitHub Classroom's grading workflow into a release (REF=, EX=)"
	@echo "make autograde SUBMISSIONS=dir grade one folder per student through nbgrader"
	@echo "               and write the class report (grading/report.html; python -m course.instructors.report grading/)"
	@echo "make bench-grade   how long make grade takes, per exercise and in all, against its targets (EX=16: one)"
	@echo "make gpu-check  every reference solution on this machine's GPUs, compared with the CPU (ARGS=mlp.py flags)"

# Instructors get everything: nbgrader for the notebooks' grading, ruff for lint.
$(VENV)/.instructors: requirements-instructors.txt $(VENV)/.notebooks
	$(SETUP) --instructors

demo: $(VENV)/.installed
	$(PY) -m course.instructors.compat_check --scripts

# The side venv lives in ~/.cache/ddp-course (course/instructors/compat_check.py): a CUDA build of torch is several GB.
compat: $(VENV)/.installed
	$(PY) -m course.instructors.compat_check $(if $(TORCH),--torch $(TORCH))

test: $(VENV)/.instructors
	COURSE_IMPL=solutions $(PYTEST) checks tests

lint: $(VENV)/.instructors
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

student: $(VENV)/.installed
	$(PY) -m course.instructors.student

bench-grade: $(VENV)/.installed
	EX="$(EX)" $(PY) bench/grade_time.py

release: $(VENV)/.instructors
	$(PY) -m course.instructors.release $(DEST)

# The Gradescope autograder (course/instructors/gradescope.py): autograder.zip; EX="6 7" grades only those exercises.
gradescope: $(VENV)/.instructors
	$(PY) -m course.instructors.gradescope build autograder.zip $(foreach e,$(EX),--ex $(e))

# GitHub Classroom (course/instructors/classroom.py, docs/classroom.md): the workflow, into the release at DEST that
# becomes the template repository TEMPLATE; its checks at REF (a tag of the release) grade.
classroom: $(VENV)/.installed
	$(PY) -m course.instructors.classroom $(DEST) --template $(TEMPLATE) $(if $(REF),--ref $(REF)) $(foreach e,$(EX),--ex $(e))

# Grades, gradebook and feedback go to OUT (default grading/); EX="2 4" grades only those exercises.
OUT ?= grading
autograde: $(VENV)/.instructors
	$(PY) -m course.instructors.autograde $(SUBMISSIONS) --out $(OUT) $(foreach e,$(EX),--ex $(e))

gpu-check: $(VENV)/.installed
	$(PY) -m course.instructors.gpu_check $(ARGS)
else
help::
	@echo "make test     the same as make grade"

test: grade
endif
