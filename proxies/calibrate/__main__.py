from proxies.calibrate.main import entry

entry()
