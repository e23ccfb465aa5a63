# Sourced by the device scripts: the reference's Python packages (transformers, diffusers and their
# pure-Python needs, see stage.sh) into /tmp/site on PYTHONPATH. PACK=1 staging carries them as one
# xz archive of the unpacked wheels (.dev/pack/site.tar.xz, 6 MB where the wheels are 21 MB), which
# keeps the repository, the packed binaries and the reference under the device tool's 64 MiB.
pysite() {
  mkdir -p /tmp/site
  if [ -f .dev/pack/site.tar.xz ]; then
    tar -C /tmp/site -xJf .dev/pack/site.tar.xz || return 1
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .dev/whl/*.whl || return 1
  fi
  export PYTHONPATH=/tmp/site
}
