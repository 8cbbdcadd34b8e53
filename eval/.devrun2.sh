python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --timeout 200 tests > $OUT/pytest.log 2>&1; echo pytest rc=$?
tail -15 $OUT/pytest.log
